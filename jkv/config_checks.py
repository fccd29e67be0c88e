"""The checks every user config's `__post_init__` is made of, so that each config's own checks
read as one line a field and a bad value is worded the same way whichever config holds it."""

from __future__ import annotations

import dataclasses
import re

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


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


def parse_bytes(value: object, name: str = "bytes") -> object:
    """A size as bytes: an int as it is, or text such as `1073741824`, `512MiB`, `8GiB`,
    `1.5G` (K/M/G/T powers of 1000, KiB/MiB/GiB/TiB of 1024; a trailing B optional). Any
    other value is returned for its config's check to refuse; bad text is a ValueError
    naming `name`."""
    if not isinstance(value, str):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]i?)?b?\s*", value, re.IGNORECASE)
    if m is None:
        raise ValueError(f"{name} must be a number of bytes such as 536870912, 512MiB or "
                         f"8GiB, got {value!r}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
