"""Chat messages to prompt token ids, with bounded work: the messages are checked, the chat
template's text is measured before it is tokenized (`max_chars`), and a session's history
that outgrows the context loses its oldest turns by a search whose renders are logarithmic in
the turns (`session_ids`), stopping between renders when the caller's `cancelled` says so.
`jkv.api.LLM` calls these with its tokenizer; the server bounds its admission with them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jkv.sched.request import Truncation

ROLES = ("system", "user", "assistant", "tool", "developer")  # chat message roles accepted
_HEAD_ROLES = ("system", "developer")  # leading messages that truncation never drops


class Cancelled(Exception):
    """The caller's `cancelled` flag was seen set: the work stopped between two steps."""


def parse_messages(messages) -> list[dict]:
    """`messages` if they are a non-empty list of {'role', 'content'} dicts, else a
    ValueError naming the first bad field."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {ROLES}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")
        check_unicode(m["content"], f"messages[{i}].content")
    return messages


def check_unicode(text: str, field: str) -> None:
    """JSON can carry a lone surrogate (\\ud800) that no tokenizer can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field} is not valid Unicode: {e.reason} at {e.start}") from None


def render(tokenizer, messages: list[dict], max_chars: int | None = None) -> str:
    """The chat template's text for `messages`, ready for the reply; a ValueError naming
    `messages` when it has more than `max_chars` characters (checked before tokenizing,
    the part whose cost grows with the text)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use generate() with a prompt")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if max_chars is not None and len(text) > max_chars:
        raise ValueError(f"messages: the rendered prompt has {len(text)} characters, more "
                         f"than max_chars={max_chars}")
    return text


def _check(cancelled: Callable[[], bool] | None) -> None:
    if cancelled is not None and cancelled():
        raise Cancelled("cancelled by the caller")


def first_fitting(count: int, fits: Callable[[int], bool],
                  cancelled: Callable[[], bool] | None = None) -> int | None:
    """The least j in [0, count) with fits(j), or None, for a `fits` that once true stays
    true as j grows. Probes from the end at distances 1, 2, 4, ... and then bisects: about
    2 log2(count - j) probes, each over no more than twice what the answer keeps."""
    _check(cancelled)
    if count < 1 or not fits(count - 1):
        return None
    good, bad, step = count - 1, -1, 1  # fits(good); bad: below it, known not to fit or -1
    while good - step >= 0:
        _check(cancelled)
        if not fits(good - step):
            bad = good - step
            break
        good, step = good - step, step * 2
    while good - bad > 1:
        _check(cancelled)
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def session_ids(messages: list[dict], render_ids: Callable[[list[dict]], list[int]],
                limit: int, cancelled: Callable[[], bool] | None = None
                ) -> tuple[list[int], Truncation | None]:
    """A session's prompt within `limit` tokens: the full history's ids if they fit, else
    the leading system messages and the latest turns from a user message on, as few turns
    dropped as fit (CachedAttention 3.4), with the `Truncation` that splices it from the
    full ids (None when the cut is no clean splice). A ValueError when even the last user
    turn does not fit; `Cancelled` between renders once `cancelled()` is true."""
    full = render_ids(messages)
    if len(full) <= limit:
        return full, None
    head = 0
    while head < len(messages) and messages[head]["role"] in _HEAD_ROLES:
        head += 1
    starts = [i for i in range(head + 1, len(messages)) if messages[i]["role"] == "user"]
    rendered: dict[int, list[int]] = {}

    def fits(j: int) -> bool:
        rendered[j] = render_ids(messages[:head] + messages[starts[j]:])
        return len(rendered[j]) <= limit

    j = first_fitting(len(starts), fits, cancelled)
    if j is None:
        raise ValueError(f"messages: the conversation's last turn and system prompt alone "
                         f"do not fit the {limit} tokens that max_model_len leaves beside "
                         f"the tokens to generate")
    return rendered[j], splice(full, rendered[j])


def splice(full: Sequence[int], ids: Sequence[int]) -> Truncation | None:
    """How `ids` is `full` less one run of tokens (keep, drop), or None if it is not."""
    keep = 0
    while keep < len(ids) and ids[keep] == full[keep]:
        keep += 1
    drop = len(full) - len(ids)
    if list(full[keep + drop:]) != list(ids[keep:]):
        return None
    return Truncation(tuple(full), keep, drop)
