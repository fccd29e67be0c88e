"""A tiered row's KV out of the pool and back: LayerKV's layer offload (a layer of a
token-tier sequence held on the host) and the store's form of a whole row.

A tiered row's layer is its page-table rows (one per KV head) and the tier counts that say
which of their columns hold pages (`allocator.held_mask`). Offloaded, the counts stay and
the held columns point at the null page; the host keeps each held page and its token
metadata at its (head, column). Brought in, every held column that is null gets a new page
with the host's bytes, so the row is as it was, and the tier policy's logic never sees the
difference. A step's growth counts in an offloaded layer's tiers without pages
(`tier_step.grow`); the bring takes them.

Inside a step (`row_layer_offload`'s hooks) each offloaded layer is brought in before it
runs, placed by the token policy right after it ran (the placement the step's call has due,
on that layer only: `TieredRows.place` with `live`), and sent out: at any moment the step
holds one offloaded layer's pages beyond the resident ones, as LayerKV's send buffer. A
placement depends only on its own (layer, KV head)'s tokens, so the tokens kept are those the
same step with every layer resident keeps. Layer-major prefill (`jkv.engine.layer_major`) is
not offered: a tier policy places a prompt's tokens after each chunk, through every layer.

A host copy is the layer's whole [KV heads, table width] of pages, null columns included
(their bytes are never read): one gather of a fixed shape, so nothing compiles per length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jkv.kv.allocator import FreeList, PageTables, allocate, unref
from jkv.kv.buckets import bucket
from jkv.kv.pages import NULL_PAGE, KVPages
from jkv.kv.tier_entries import gather_row, place_row, row_layout
from jkv.kv.token_tiers import TierCounts, TokenMeta


def _held(tables: PageTables, counts: TierCounts, slot: jax.Array, layer: jax.Array,
          page: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(slot, layer)'s table rows [H, W], which columns hold pages by its counts, and the
    high and low page counts [H] those give."""
    row = tables.pages[slot, layer]
    w = row.shape[-1]
    col = jnp.arange(w, dtype=jnp.int32)
    hp = (counts.high[slot, layer] + page - 1) // page
    lp = (counts.low[slot, layer] + 2 * page - 1) // (2 * page)
    return row, (col < hp[:, None]) | (col >= w - lp[:, None]), hp, lp


@partial(jax.jit, donate_argnums=(2, 3))
def send(pool: KVPages, meta: TokenMeta, free: FreeList, tables: PageTables,
         counts: TierCounts, slot: jax.Array, layer: jax.Array) -> tuple:
    """(slot, layer)'s pages and token metadata as [H, W, ...] (on their way out), its pages
    released and its held columns null: (copy, free, tables)."""
    row, held, _, _ = _held(tables, counts, slot, layer, free.page_size)
    ids = jnp.where(held, row, NULL_PAGE)
    copy = (jax.tree.map(lambda x: x[ids], pool), meta.score[ids], meta.pos[ids])
    free = unref(free, ids)
    tables = tables.replace(pages=tables.pages.at[slot, layer].set(
        jnp.where(held, NULL_PAGE, row)))
    return copy, free, tables


@partial(jax.jit, donate_argnums=(0, 1, 2, 3))
def bring(pool: KVPages, meta: TokenMeta, free: FreeList, tables: PageTables,
          counts: TierCounts, slot: jax.Array, layer: jax.Array, copy: tuple) -> tuple:
    """Every held column of (slot, layer) that is null gets a new page holding `copy`'s
    bytes and metadata at its (head, column): (pool, meta, free, tables, ok); nothing
    changes when the pool is short (ok False)."""
    page = free.page_size
    row, held, hp, lp = _held(tables, counts, slot, layer, page)
    need = held & (row == NULL_PAGE)
    w = row.shape[-1]
    free, ids, ok = allocate(free, need.sum(-1), w)
    rank = jnp.clip(jnp.cumsum(need, -1) - 1, 0, w - 1)
    taken = need & ok
    new_row = jnp.where(taken, jnp.take_along_axis(ids, rank, -1), row)
    dest = jnp.where(taken, new_row, meta.score.shape[0]).reshape(-1)
    pages, score, pos = copy

    def put(x: jax.Array, src: jax.Array) -> jax.Array:
        return x.at[dest].set(src.reshape(-1, *src.shape[2:]).astype(x.dtype), mode="drop")

    pool = jax.tree.map(put, pool, pages)
    meta = TokenMeta(score=put(meta.score, score), pos=put(meta.pos, pos))
    at = (slot, layer)
    tables = tables.replace(
        pages=tables.pages.at[at].set(new_row),
        num_pages=tables.num_pages.at[at].set(jnp.where(ok, hp, tables.num_pages[at])),
        low_pages=tables.low_pages.at[at].set(jnp.where(ok, lp, tables.low_pages[at])))
    return pool, meta, free, tables, ok


@dataclass
class HostRowLayer:
    """One offloaded (slot, layer) of a tiered row: its [H, W] pages and token metadata
    (device arrays on their way to the host until `settle`)."""

    copy: tuple

    def settle(self) -> None:
        self.copy = jax.device_get(self.copy)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self.copy))


def host_row_pages(layout: dict[str, np.ndarray], pages: KVPages, score: jax.Array,
                   pos: jax.Array, held: dict[int, HostRowLayer], heads: int) -> tuple:
    """A row gathered for the store (`RowMoves.tier_pages`: its layers on the host read
    null pages) with those layers' pages and metadata taken from their host copies, as
    host arrays."""
    pages, score, pos = jax.device_get((pages, score, pos))
    arrays = {k: np.array(x) for k, x in pages.arrays().items()}
    score, pos = np.array(score), np.array(pos)
    head, low, index = layout["tier_head"], layout["tier_low"], layout["tier_index"]
    for layer, host in held.items():
        host.settle()
        copy, copy_score, copy_pos = host.copy
        width = copy_score.shape[1]
        rows = np.flatnonzero((head >= 0) & (head // heads == layer))
        h = head[rows] % heads
        col = np.where(low[rows] == 1, width - 1 - index[rows], index[rows])
        for name, x in copy.arrays().items():
            arrays[name][rows] = x[h, col]
        score[rows], pos[rows] = copy_score[h, col], copy_pos[h, col]
    return KVPages.from_arrays(pages.kv_format, arrays), score, pos


class RowMoves:
    """A tiered row's KV out of the pool and back, writing the layout's state (`KVState` and
    the tiers'): built by `TieredRows` with its state; a layer at a time for
    `RowLayerOffload`, whole for the store (`RowConnector`)."""

    def __init__(self, kv: object, tiers: object, layer_pages: Callable,
                 make_room: Callable, page_size: int, num_kv_heads: int) -> None:
        self.kv, self.t, self.layer_pages, self.make_room = kv, tiers, layer_pages, make_room
        self.page_size, self.num_kv_heads = page_size, num_kv_heads
        self.oks: list[jax.Array] = []  # bring flags not yet read

    def send(self, slot: int, layer: int, pool: KVPages | None = None,
             meta: TokenMeta | None = None) -> HostRowLayer:
        """(slot, layer) leaves the pool (`pool`, `meta`: a call's own; None: the state's)."""
        kv, t = self.kv, self.t
        copy, kv.free, kv.tables = send(kv.pool if pool is None else pool,
                                        t.meta if meta is None else meta, kv.free, kv.tables,
                                        t.counts, np.int32(slot), np.int32(layer))
        for x in jax.tree.leaves(copy):
            x.copy_to_host_async()
        host = HostRowLayer(copy)
        kv.offloaded.setdefault(slot, {})[layer] = host
        if pool is None:  # between steps: the host count follows (a step's: `after_step`)
            kv.free_pages += int(self.layer_pages(slot)[layer])
        return host

    def bring(self, slot: int, layer: int, pool: KVPages | None = None,
              meta: TokenMeta | None = None) -> tuple[KVPages, TokenMeta]:
        """(slot, layer) back into the pool, still counted offloaded until `resident`;
        returns the pool and metadata (a call's own, or the state's)."""
        kv, t = self.kv, self.t
        own = pool is None
        host = kv.offloaded[slot][layer]
        pool, meta, kv.free, kv.tables, ok = bring(
            kv.pool if own else pool, t.meta if own else meta, kv.free, kv.tables, t.counts,
            np.int32(slot), np.int32(layer), host.copy)
        self.oks.append(ok)
        if own:
            kv.pool, t.meta = pool, meta
            kv.free_pages -= int(self.layer_pages(slot)[layer])
        return pool, meta

    def tier_pages(self, slot: int) -> tuple[dict[str, np.ndarray], KVPages, jax.Array,
                                             jax.Array]:
        """The pages `slot`'s tiers hold, as the store keeps a tiered row: (the layout,
        `tier_entries.row_layout`, padded to a bucket of pages with head -1; the pages and
        their token metadata score, pos, device arrays being gathered)."""
        kv, t = self.kv, self.t
        layout = row_layout(t.high[slot], t.low[slot], self.page_size)
        n = len(layout["tier_head"])
        rows = bucket(max(n, 1))
        padded = {k: np.pad(x, (0, rows - n), constant_values=-1 if k == "tier_head" else 0)
                  for k, x in layout.items()}
        pages, score, pos = gather_row(kv.pool, t.meta, kv.tables, np.int32(slot),
                                       *(jnp.asarray(padded[k]) for k in
                                         ("tier_head", "tier_low", "tier_index")))
        if kv.offloaded.get(slot):
            pages, score, pos = host_row_pages(padded, pages, score, pos, kv.offloaded[slot],
                                               self.num_kv_heads)
        return padded, pages, score, pos

    def warmup(self) -> None:
        """Compile `tier_pages`' gather for every bucket of pages a row can hold, reading the
        null page only (head -1)."""
        kv, t = self.kv, self.t
        most, n = kv.tables.pages[0].size, 1  # (a slot's every column of every layer)
        while True:
            none = jnp.asarray(np.full(n, -1, np.int32))
            jax.block_until_ready(gather_row(kv.pool, t.meta, kv.tables, np.int32(0), none,
                                             none, none))
            if n >= most:
                break
            n *= 2

    def place_tiers(self, slot: int, layout: dict[str, np.ndarray], pages: KVPages,
                    score: np.ndarray, pos: np.ndarray, high: np.ndarray, low: np.ndarray,
                    tokens: int) -> bool:
        """Start the empty `slot` with saved tiered pages (`tier_pages`' form, checked by the
        caller; high, low [L, H]) holding its first `tokens` tokens; False when the pages
        cannot be had (nothing changes)."""
        n = len(layout["tier_head"])
        if not self.make_room(n):
            return False
        rows = bucket(max(n, 1))

        def pad(x: np.ndarray, fill: int = 0) -> jax.Array:
            return jnp.asarray(np.pad(x, [(0, rows - n)] + [(0, 0)] * (x.ndim - 1),
                                      constant_values=fill))

        pages = KVPages.from_arrays(pages.kv_format, {k: pad(x) for k, x in
                                                      pages.arrays().items()})
        kv, t = self.kv, self.t
        (kv.pool, t.meta, kv.free, kv.tables, t.counts, ok) = place_row(
            kv.pool, t.meta, kv.free, kv.tables, t.counts, pages, pad(score), pad(pos),
            pad(layout["tier_head"], -1), pad(layout["tier_low"]), pad(layout["tier_index"]),
            jnp.asarray(high, jnp.int32), jnp.asarray(low, jnp.int32), np.int32(slot),
            np.int32(tokens))
        if not bool(ok):
            raise RuntimeError("placing restored tiers failed although the host count allowed it")
        kv.free_pages -= n
        t.high[slot], t.low[slot] = high, low
        return True

    def resident(self, slot: int) -> None:
        """Every layer of `slot` has been brought back."""
        self.kv.offloaded.pop(slot, None)
