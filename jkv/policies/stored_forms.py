"""The smaller stored forms of a token-tier row that policies offer on save, by name.

A policy with a `form_merit` (streaming, h2o) offers `<name>@<keep>`: the row with about
`keep` of each (layer, KV head)'s tokens, the sinks and the recent window, then those of
highest merit (`jkv.kv.row_forms.drop_tokens` drops the rest without the model). AdaptCache
picks among them as among KV formats; the store and its profiles read the names only.
`keep` counts against the row as the engine kept it: `h2o@0.25` made from `h2o@0.5` keeps
half of what that form holds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from jkv.kv.format import KVFormat
from jkv.kv.row_forms import Merit, drop_tokens


def row_form_ways() -> dict[str, Merit]:
    """Each policy offering smaller stored forms: its name and `form_merit`."""
    from jkv.policies import POLICIES  # (this module is found while the registry is made)

    return {p.name: p.form_merit for p in POLICIES.values() if p.form_merit is not None}


def parse_row_form(name: str) -> tuple[str, float] | None:
    """`<way>@<keep>` as (way, keep), keep in (0, 1); None when `name` is not a row form."""
    way, at, keep = name.partition("@")
    if not at or way not in row_form_ways():
        return None
    try:
        frac = float(keep)
    except ValueError:
        return None
    return (way, frac) if math.isfinite(frac) and 0 < frac < 1 else None


def is_row_form(name: str) -> bool:
    return parse_row_form(name) is not None


def convert_row(arrays: Mapping[str, np.ndarray], src: str, dst: str, kv_format: KVFormat,
                *, heads: int, page: int, sinks: int, recent: int) -> dict[str, np.ndarray]:
    """A stored token-tier row in form `src` as form `dst` (each the pool's format name or a row
    form). Into the pool's format: the row as it is (its dropped tokens stay absent); into
    a row form: `drop_tokens` at that form's share of `src`'s. ValueError for a form that is
    neither, or one that would not be smaller."""
    pool = kv_format.name
    forms = {}
    for side, name in (("src", src), ("dst", dst)):
        if name == pool:
            forms[side] = None
        elif (form := parse_row_form(name)) is not None:
            forms[side] = form
        else:
            raise ValueError(f"{side} {name!r} is neither the pool's format ({pool}) nor a "
                             f"row form <way>@<keep> with way in {sorted(row_form_ways())}")
    if forms["dst"] is None:
        return {k: np.asarray(x) for k, x in arrays.items()}
    way, keep = forms["dst"]
    held = 1.0 if forms["src"] is None else forms["src"][1]
    if keep >= held:
        raise ValueError(f"a row in {src} cannot become {dst}: forms only shrink")
    return drop_tokens(arrays, kv_format, keep / held, row_form_ways()[way], heads=heads,
                       page=page, sinks=sinks, recent=recent)


__all__ = ["convert_row", "is_row_form", "parse_row_form", "row_form_ways"]
