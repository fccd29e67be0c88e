"""What a chat's messages must be before a template renders them: the library's checks, with
errors naming the field (the server answers them as 400s)."""

from __future__ import annotations

ROLES = ("system", "user", "assistant", "tool", "developer")  # chat message roles accepted


def parse_messages(messages: object) -> list[dict]:
    """`messages` itself, once each is a {'role', 'content'} dict a template can render."""
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
