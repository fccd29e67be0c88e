"""Smaller forms of a stored token-tier row: tokens dropped without the model (for a store
behind a token-tier engine; `jkv.policies.stored_forms` names the forms a policy offers).

A token-tier row (`tier_entries.row_layout`: its pages with their tier, index and tokens, and
each token slot's position and received attention) already keeps only what its policy let it
keep. `drop_tokens` keeps about `keep` of each (layer, KV head)'s tokens: the sinks (positions
below `sinks`) and the recent window (the newest `recent` positions), never dropped as no
policy drops them, then those of highest merit (the policy's `form_merit`). Kept tokens stay
in their tier and their slot order; the row is rebuilt dense (`row_layout` of the new
counts) in the same KV format, so it is restored like any token-tier row, its dropped tokens
absent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from jkv.kv.format import KVFormat
from jkv.kv.pages import KVPages
from jkv.kv.tier_entries import TIER_ARRAYS, row_layout

Merit = Callable[[np.ndarray, np.ndarray, int], np.ndarray]  # (pos, score, n) -> merit


def _kept(t_head: np.ndarray, t_pos: np.ndarray, t_score: np.ndarray, keep: float,
          merit_of: Merit, *, heads: int, sinks: int, recent: int) -> np.ndarray:
    """Which of a row's held tokens (each's head, position and summed score) a form keeps:
    per head the sinks and the recent window, then the best by `merit_of` up to `keep`
    of the head's tokens (the choice alone; `drop_tokens` rebuilds the row from it)."""
    n = int(t_pos.max()) + 1 if len(t_pos) else 0  # the newest token is always held
    protected = (t_pos < sinks) | (t_pos >= n - recent)
    merit = np.asarray(merit_of(t_pos, t_score, n), np.float64)
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


def drop_tokens(arrays: Mapping[str, np.ndarray], kv_format: KVFormat, keep: float,
                merit: Merit, *, heads: int, page: int, sinks: int,
                recent: int) -> dict[str, np.ndarray]:
    """A token-tier row's arrays (its real pages only) with about `keep` of each (layer, KV
    head)'s tokens kept, the sinks, the window and the highest `merit`; see the module
    docstring."""
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
    kept = _kept(t_head, t_pos, t_score, keep, merit, heads=heads, sinks=sinks,
                 recent=recent)
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


__all__ = ["Merit", "drop_tokens"]
