"""Session truncation under the embedded SmolLM2 chat template: the same prompt as dropping
the oldest turns one at a time, in renders logarithmic in the turns, stopped by a cancel
flag; the rendered text's size limit."""

from __future__ import annotations

import random

import pytest

from jkv.models.loaders import default_model_path
from jkv.models.tokenizer import load_tokenizer
from jkv.prompts import Cancelled, render, session_ids, splice

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


class Renders:
    """The template's ids for messages, counting its calls."""

    def __init__(self, tok) -> None:
        self.tok, self.calls = tok, 0

    def __call__(self, messages: list[dict]) -> list[int]:
        self.calls += 1
        return self.tok.encode(render(self.tok, messages), add_special_tokens=False)


def reference(messages: list[dict], render_ids, limit: int):
    """Today's rule spelled out: drop the oldest turn after the system messages, one at a
    time, until the prompt fits and starts its kept turns with a user message."""
    full = render_ids(messages)
    if len(full) <= limit:
        return full, None
    head = 0
    while head < len(messages) and messages[head]["role"] in ("system", "developer"):
        head += 1
    for start in range(head + 1, len(messages)):
        if messages[start]["role"] == "user":
            ids = render_ids(messages[:head] + messages[start:])
            if len(ids) <= limit:
                return ids, splice(full, ids)
    raise ValueError("does not fit")


def history(rng: random.Random, turns: int) -> list[dict]:
    words = ["river", "stone", "why", "7", "the", "a", "mountain", "ok", "!", "ocean"]
    head = [{"role": rng.choice(["system", "developer"]), "content": "Be terse."}
            for _ in range(rng.choice([0, 0, 1, 2]))]
    body = [{"role": rng.choice(["user", "user", "assistant", "assistant", "tool"]),
             "content": " ".join(rng.choices(words, k=rng.randrange(0, 40)))}
            for _ in range(turns)]
    return head + body


def test_truncation_gives_the_prompt_that_dropping_one_turn_at_a_time_gives(tok):
    rng = random.Random(54)
    for case in range(60):
        messages = history(rng, rng.randrange(1, 60))
        limit = rng.randrange(20, 600)
        try:
            want = reference(messages, Renders(tok), limit)
        except ValueError:
            with pytest.raises(ValueError, match="do not fit"):
                session_ids(messages, Renders(tok), limit)
            continue
        assert session_ids(messages, Renders(tok), limit) == want, (case, limit)


def test_a_long_history_is_cut_in_logarithmically_many_renders(tok):
    messages = [{"role": "system", "content": "Be terse."}]
    for i in range(5000):
        messages += [{"role": "user", "content": f"message {i}"},
                     {"role": "assistant", "content": "ok"}]
    renders = Renders(tok)
    ids, cut = session_ids(messages, renders, 2000)
    assert cut is not None and 1900 < len(ids) <= 2000  # about 150 turns kept
    assert "message 4999" in tok.decode(ids) and "message 4800" not in tok.decode(ids)
    assert renders.calls <= 2 + 2 * 8  # the full history, then 2 log2(turns kept) at most


def test_a_set_cancel_flag_stops_truncation_between_renders(tok):
    messages = [{"role": "user", "content": f"message {i}"} for i in range(2000)]
    renders = Renders(tok)
    with pytest.raises(Cancelled):
        session_ids(messages, renders, 100, cancelled=lambda: renders.calls >= 3)
    assert renders.calls == 3


def test_a_rendered_prompt_over_max_chars_is_refused_naming_messages(tok):
    messages = [{"role": "user", "content": "hi"}]
    size = len(render(tok, messages))
    assert render(tok, messages, max_chars=size) == render(tok, messages)
    with pytest.raises(ValueError, match=rf"^messages: .*max_chars={size - 1}"):
        render(tok, messages, max_chars=size - 1)
