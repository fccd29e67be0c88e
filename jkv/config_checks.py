"""The checks every user config's `__post_init__` is made of, so that each config's own checks
read as one line a field and a bad value is worded the same way whichever config holds it."""

from __future__ import annotations

import dataclasses


def is_int(value: object) -> bool:
    """An int that is not a bool: bool is an int subclass, so True would pass as 1."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_pow2(value: object) -> bool:
    """Whether `value` is a positive power of two (page_size, prefill_chunk)."""
    return is_int(value) and value > 0 and not value & (value - 1)


def require(config: object, name: str, ok: bool, wanted: str) -> None:
    """ValueError naming `Config.name` unless `ok`."""
    if not ok:
        raise ValueError(f"{type(config).__name__}.{name} must be {wanted}, "
                         f"got {getattr(config, name)!r}")


def check_choices_and_flags(config: object) -> None:
    """The checks the configs share: a field with choices holds one of them, a bool field a
    bool (CacheConfig checks kv_format itself: it holds a KVFormat once made)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if "choices" in f.metadata:
            require(config, f.name, value in f.metadata["choices"],
                    f"one of {f.metadata['choices']}")
        elif isinstance(f.default, bool):
            require(config, f.name, isinstance(value, bool), "True or False")
