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
