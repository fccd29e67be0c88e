"""The reply-length estimate TPOT slack and the layer-offload checks weigh."""

from __future__ import annotations

from jkv.sched.output_lengths import OutputLengths


def test_output_lengths_estimate_low_from_the_session_then_recent_replies():
    lengths = OutputLengths(quantile=0.25)
    assert lengths.remaining("s", 100, 0) == 1  # nothing seen: only the next token is certain
    for n in (40, 80, 120, 160, 200):
        lengths.add(None, n)
    assert lengths.remaining("s", 100, 0) == 80  # a low quantile of recent replies (80)
    assert lengths.remaining("s", 100, 30) == 50
    lengths.add("s", 20)
    lengths.add("s", 24)
    assert lengths.remaining("s", 100, 0) == 21
    assert lengths.remaining(None, 8, 0) == 8  # max_tokens


def test_a_million_session_ids_keep_only_the_latest_sessions():
    """Per-session state is bounded: the `max_sessions` sessions answered last are kept (an
    older one answered again moves up); a forgotten session falls back to recent replies."""
    lengths = OutputLengths(max_sessions=1000)
    lengths.add("kept", 5)
    for i in range(1_000_000):
        lengths.add(f"s{i}", 30 + i % 7)
        if i % 500 == 0:
            lengths.add("kept", 5)  # answered again: stays among the latest
            assert lengths.remaining(f"s{i}", 100, 0) >= 1  # (its estimate cached too)
    assert len(lengths.sessions) == 1000 and len(lengths._totals) <= 1002
    assert "s0" not in lengths.sessions and "s999999" in lengths.sessions
    assert lengths.remaining("kept", 100, 0) == 5
    assert len(lengths.sessions["kept"]) == 16  # never forgotten: its whole history kept
    assert lengths.remaining("s0", 100, 0) == lengths.remaining(None, 100, 0)
