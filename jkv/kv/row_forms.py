"""Smaller forms of a stored token-tier row: tokens dropped without the model (AdaptCache's
StreamingLLM-style and score-pruned forms, for a store behind a token-tier engine).

A token-tier row (`tier_entries.row_layout`: its pages with their tier, index and tokens, and each
token slot's position and received attention) already keeps only what its policy (LeanKV,
H2O, StreamingLLM) let it keep. A form `<way>@<keep>` keeps about `keep` of each (layer, KV
head)'s tokens:

- `streaming@<keep>`: the attention sinks and the newest tokens (StreamingLLM's choice);
- `h2o@<keep>`: the sinks, the recent window, then the tokens with the most mean attention
  received (the scores the row stores: LeanKV's significance, H2O's heavy hitters).

The sinks (positions below `sinks`) and the recent window (the newest `recent` positions) are
never dropped, as no policy drops them. Kept tokens stay in their tier and their slot order;
the row is rebuilt dense (`row_layout` of the new counts) in the same KV format, so it is
restored like any token-tier row, its dropped tokens absent. `keep` counts against the row as
the engine kept it: `h2o@0.25` made from `h2o@0.5` keeps half of what that form holds.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jkv.kv.format import KVFormat
from jkv.kv.pages import KVPages
from jkv.kv.row_form_names import WAYS, parse_row_form
from jkv.kv.tier_entries import TIER_ARRAYS, row_layout


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
                             f"row form <way>@<keep> with way in {WAYS}")
    if forms["dst"] is None:
        return {k: np.asarray(x) for k, x in arrays.items()}
    way, keep = forms["dst"]
    held = 1.0 if forms["src"] is None else forms["src"][1]
    if keep >= held:
        raise ValueError(f"a row in {src} cannot become {dst}: forms only shrink")
    return drop_tokens(arrays, kv_format, keep / held, way, heads=heads, page=page,
                       sinks=sinks, recent=recent)


def _kept(t_head: np.ndarray, t_pos: np.ndarray, t_score: np.ndarray, keep: float, way: str,
          *, heads: int, sinks: int, recent: int) -> np.ndarray:
    """Which of a row's held tokens (each's head, position and summed score) a form keeps:
    per head the sinks and the recent window, then the best by `way`'s merit up to `keep`
    of the head's tokens (the choice alone; `drop_tokens` rebuilds the row from it)."""
    n = int(t_pos.max()) + 1 if len(t_pos) else 0  # the newest token is always held
    protected = (t_pos < sinks) | (t_pos >= n - recent)
    if way == "streaming":
        merit = t_pos.astype(np.float64)
    else:  # mean attention received: from the n - pos queries at or after the token
        merit = t_score.astype(np.float64) / np.maximum(n - t_pos, 1)
    # rank per head: protected first, then by merit (ties: the earlier token)
    order = np.lexsort((t_pos, -merit, ~protected, t_head))
    per_head = np.bincount(t_head, minlength=heads)
    start = np.cumsum(per_head) - per_head
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order)) - start[t_head[order]]
    budget = np.maximum(np.ceil(keep * per_head).astype(np.int64),
                        np.bincount(t_head, protected, heads).astype(np.int64))
    return rank < budget[t_head]


def _copy_tokens(arrays: Mapping[str, np.ndarray], kv_format: KVFormat, m: int,
                 low: np.ndarray, src_at: tuple[np.ndarray, np.ndarray],
                 dst_at: tuple[np.ndarray, np.ndarray]) -> dict[str, np.ndarray]:
    """The new row's page arrays ([m, ...]): each kept token's K/V (`low`: in the low tier)
    copied from (page row, offset) `src_at` of the row's pages to `dst_at`, bit for bit. On the
    host (numpy: a row's shapes vary, jnp would compile for each): each tier's tokens
    through its view of the pages, a reshape (a low page: 2 * page tokens)."""
    (src_row, src_off), (dst_row, dst_off) = src_at, dst_at
    src_pages = KVPages.from_arrays(kv_format, {
        k: np.ascontiguousarray(x) for k, x in arrays.items() if k not in TIER_ARRAYS})
    dst_pages = KVPages.from_arrays(kv_format, {
        k: np.zeros((m, *x.shape[1:]), x.dtype) for k, x in src_pages.arrays().items()})
    for tier in (0, 1):
        sel = low == tier
        if sel.any():
            fmt = kv_format if tier == 0 else kv_format.halved()
            src, dst = src_pages.as_format(fmt).arrays(), dst_pages.as_format(fmt).arrays()
            for name, out in dst.items():  # (views of dst_pages' arrays)
                out[dst_row[sel], dst_off[sel]] = src[name][src_row[sel], src_off[sel]]
    return {k: np.asarray(x) for k, x in dst_pages.arrays().items()}


def drop_tokens(arrays: Mapping[str, np.ndarray], kv_format: KVFormat, keep: float, way: str,
                *, heads: int, page: int, sinks: int, recent: int) -> dict[str, np.ndarray]:
    """A token-tier row's arrays (its real pages only) with about `keep` of each (layer, KV
    head)'s tokens kept, chosen `way` (`WAYS`); see the module docstring."""
    if way not in WAYS:
        raise ValueError(f"way must be one of {WAYS}, got {way!r}")
    if not 0 < keep <= 1:
        raise ValueError(f"keep must be in (0, 1], got {keep}")
    head, is_low, index, count = (np.asarray(arrays[k], np.int64) for k in TIER_ARRAYS[:4])
    score, pos = np.asarray(arrays["tier_score"]), np.asarray(arrays["tier_pos"])
    # every held token: its page row and offset, (head, tier), slot in its tier, pos, score
    cap = np.where(is_low == 1, 2 * page, page)
    off = np.arange(2 * page)
    held = off[None, :] < count[:, None]
    rows, offs = np.nonzero(held)
    t_head, t_low = head[rows], is_low[rows]
    t_slot = index[rows] * cap[rows] + offs
    t_pos, t_score = pos[rows, offs].astype(np.int64), score[rows, offs]
    kept = _kept(t_head, t_pos, t_score, keep, way, heads=heads, sinks=sinks, recent=recent)
    # kept tokens, in (head, tier, slot) order, are the new row's slots 0, 1, ... per tier
    k_idx = np.flatnonzero(kept)
    k_idx = k_idx[np.lexsort((t_slot[k_idx], t_low[k_idx], t_head[k_idx]))]
    high = np.bincount(t_head[k_idx][t_low[k_idx] == 0], minlength=heads)
    low = np.bincount(t_head[k_idx][t_low[k_idx] == 1], minlength=heads)
    layout = row_layout(high, low, page)
    group = t_head[k_idx] * 2 + t_low[k_idx]
    sizes = np.bincount(group, minlength=2 * heads)
    j = np.arange(len(k_idx)) - (np.cumsum(sizes) - sizes)[group]  # new slot in its tier
    new_cap = np.where(t_low[k_idx] == 1, 2 * page, page)
    pages_per = np.stack([-(-high // page), -(-low // (2 * page))], -1).ravel()
    first_row = np.cumsum(pages_per) - pages_per
    dst_row, dst_off = first_row[group] + j // new_cap, j % new_cap
    src_row, src_off = rows[k_idx], offs[k_idx]
    # the token metadata to the same slots
    m = len(layout["tier_head"])
    out_score, out_pos = np.zeros((m, 2 * page), score.dtype), np.zeros((m, 2 * page), pos.dtype)
    out_score[dst_row, dst_off] = score[src_row, src_off]
    out_pos[dst_row, dst_off] = pos[src_row, src_off]
    pages = _copy_tokens(arrays, kv_format, m, t_low[k_idx], (src_row, src_off),
                         (dst_row, dst_off))
    return {**pages, **layout, "tier_score": out_score, "tier_pos": out_pos}


__all__ = ["convert_row", "drop_tokens"]
