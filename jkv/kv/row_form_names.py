"""Names of a stored token-tier row's smaller forms, `<way>@<keep>` (`jkv.kv.row_forms` makes
them): the store and its profiles read the names without the cache's arrays."""

from __future__ import annotations

import math

WAYS = ("streaming", "h2o")  # the sinks and the newest tokens; or the most attended too


def parse_row_form(name: str) -> tuple[str, float] | None:
    """`<way>@<keep>` as (way, keep), keep in (0, 1); None when `name` is not a row form."""
    way, at, keep = name.partition("@")
    if not at or way not in WAYS:
        return None
    try:
        frac = float(keep)
    except ValueError:
        return None
    return (way, frac) if math.isfinite(frac) and 0 < frac < 1 else None


def is_row_form(name: str) -> bool:
    return parse_row_form(name) is not None


__all__ = ["WAYS", "is_row_form", "parse_row_form"]
