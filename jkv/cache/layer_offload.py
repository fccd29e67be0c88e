"""LayerKV's layer-wise offload: some layers of a slot's KV held in host memory, not pages.

Each layer of a slot is resident (its table row holds a page per block) or offloaded: the
contents of its own full pages sit on the host (`HostLayer`) and its row keeps only the
leading blocks it shares with the prefix cache (the cache holds those pages anyway). A
prompt can then be prefilled while the pool holds only some of its layers (LayerKV 3.3):
the pool is the send buffer. A step over a row with offloaded layers brings each such
layer's pages in just before the layer runs (`bring`: pages taken, the host copy written
into them) and sends them out after it (`send`: the new full pages copied to the host, the
pages freed), so at any moment the step holds one offloaded layer's pages beyond the
resident ones. `fetch` brings an idle slot's layers back for good (before its decode steps,
which would otherwise move every offloaded layer each step), `offload` pushes an idle slot's
layers out. `resident_layers` spreads the resident layers evenly over the depth (LayerKV
3.3: the copy out of an offloaded layer runs while the resident layer after it computes).

The page counts are the manager's (`KVCacheManager.offloaded`, `pages_held`): every call
here changes the host count of free pages by exactly what it frees or takes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jkv.averages import moving_average
from jkv.cache.allocator import FreeList, PageTables, reserve, unref
from jkv.cache.connector import power_of_two_runs
from jkv.cache.kv_cache import KVCacheManager
from jkv.cache.transfer import gather_pages, scatter_pages
from jkv.pallas_kernels.kv_pages import NULL_PAGE, KVPages


def resident_layers(num_layers: int, keep: int) -> np.ndarray:
    """Which of `num_layers` layers stay in the pool when `keep` of them do, spread evenly
    (8 layers, keep 4: layers 1, 3, 5 and 7), as bool [num_layers]."""
    if not 0 <= keep <= num_layers:
        raise ValueError(f"keep must be in 0..{num_layers}, got {keep}")
    i = np.arange(num_layers)
    return (i + 1) * keep // num_layers > i * keep // num_layers


@dataclass
class HostLayer:
    """One offloaded (slot, layer): the slot's table keeps blocks [0, first) of it (shared
    with the prefix cache), the host holds its own full blocks from `first` on."""

    first: int
    # its full blocks' pages [k, KV heads, ...] in order: device arrays being copied to the
    # host until `settle`, then host arrays
    parts: list[KVPages] = field(default_factory=list)

    @property
    def blocks(self) -> int:
        return sum(p.k.shape[0] for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


@partial(jax.jit, static_argnames="count")
def layer_page_ids(pages: jax.Array, slot: jax.Array, layer: jax.Array, first: jax.Array,
                   count: int) -> jax.Array:
    """Page ids of table columns [first, first + count) of (slot, layer) as [count, KV
    heads] (pages: the tables' [S, L, H, W])."""
    cols = first + jnp.arange(count)
    return jnp.take(pages[slot, layer], cols, axis=-1, mode="fill", fill_value=NULL_PAGE).T


@jax.jit
def drop_layers(free: FreeList, tables: PageTables, slot: jax.Array, layers: jax.Array,
                first: jax.Array) -> tuple[FreeList, PageTables]:
    """Drop the entries of `slot`'s rows of `layers` (bool [L]) from column `first` on:
    their references go, pages no one else holds are freed; the rows keep `first` pages."""
    row, held = tables.pages[slot], tables.num_pages[slot]  # [L, H, W], [L, H]
    j = jnp.arange(row.shape[-1])
    drop = layers[:, None, None] & (j >= first) & (j < held[..., None])
    return unref(free, jnp.where(drop, row, NULL_PAGE)), tables.replace(
        pages=tables.pages.at[slot].set(jnp.where(drop, NULL_PAGE, row)),
        num_pages=tables.num_pages.at[slot].set(
            jnp.where(layers[:, None], jnp.minimum(held, first), held)))


@jax.jit
def grow_layers(free: FreeList, tables: PageTables, slot: jax.Array, layers: jax.Array,
                tokens: jax.Array) -> tuple[FreeList, PageTables, jax.Array]:
    """Give `slot`'s rows of `layers` (bool [L]) the pages to hold `tokens` tokens; no other
    row changes. Returns (free, tables, ok) as `reserve` does."""
    s, n_layers, heads = tables.num_pages.shape
    want = jnp.zeros((s, n_layers, heads), jnp.int32).at[slot].set(
        jnp.where(layers[:, None], tokens, 0))
    return reserve(free, tables, jnp.zeros((s,), jnp.int32), want)


class LayerOffload:
    """Moves layers of a `KVCacheManager`'s slots between its pool and the host."""

    def __init__(self, cache: KVCacheManager) -> None:
        if cache.tiers is not None:
            raise ValueError("layer offload needs block pages: a token-tier policy's rows "
                             "are not blocks")
        self.cache = cache
        self.offloaded_bytes = 0  # copied to the host, over the engine's life
        self.fetched_bytes = 0  # copied back into the pool
        self.offload_bytes_per_s = 0.0  # measured copy rate out of the pool (LayerKV eq. 4)
        self._unchecked: list[jax.Array] = []  # a step's reservation flags, read by `settle`

    def layers(self, slot: int) -> list[int]:
        """The offloaded layers of `slot`."""
        return sorted(self.cache.offloaded.get(slot, {}))

    def _mask(self, layers: Sequence[int]) -> jax.Array:
        mask = np.zeros(self.cache.num_layers, bool)
        mask[list(layers)] = True
        return jnp.asarray(mask)

    def _own_pages(self, slot: int, first: int, tokens: int) -> int:
        """Pages one layer of `slot` holds past its shared blocks when it holds `tokens`."""
        return (-(-tokens // self.cache.page_size) - first) * self.cache.num_kv_heads

    # ------------------------------------------------------------------ idle slots

    def offload(self, slot: int, layers: Sequence[int]) -> int:
        """Move `slot`'s `layers` (those still resident) to the host, freeing their own
        pages; returns the pages freed. The slot must not be mid-restore (the connector
        writes its queue first)."""
        c = self.cache
        layers = [int(x) for x in layers if int(x) not in c.offloaded.get(slot, {})]
        bad = [x for x in layers if not 0 <= x < c.num_layers]
        if bad:
            raise ValueError(f"layers must be in 0..{c.num_layers - 1}, got {bad}")
        if not layers:
            return 0
        tokens = len(c.slot_tokens[slot])
        first = len(c.shared_rows(slot))
        held = c.offloaded.setdefault(slot, {})
        compiled, t0, before = gather_pages._cache_size(), time.perf_counter(), \
            self.offloaded_bytes
        for layer in layers:
            held[layer] = HostLayer(first)
            self._copy_out(c.pool, slot, layer, held[layer], tokens // c.page_size)
        self.settle()  # on the host now: the copy timed (a compile is not a copy rate)
        if gather_pages._cache_size() == compiled and self.offloaded_bytes > before:
            rate = (self.offloaded_bytes - before) / max(time.perf_counter() - t0, 1e-9)
            self.offload_bytes_per_s = moving_average(self.offload_bytes_per_s, rate)
        c.free, c.tables = drop_layers(c.free, c.tables, jnp.int32(slot), self._mask(layers),
                                       jnp.int32(first))
        freed = self._own_pages(slot, first, tokens) * len(layers)
        c.free_pages += freed
        return freed

    def pages_to_fetch(self, slot: int) -> int:
        """Pages `fetch(slot)` takes."""
        c = self.cache
        return sum(self._own_pages(slot, h.first, len(c.slot_tokens[slot]))
                   for h in c.offloaded.get(slot, {}).values())

    def fetch(self, slot: int) -> None:
        """Bring every offloaded layer of `slot` back into the pool. RuntimeError when the
        pages cannot be had (check `pages_to_fetch` against `available_pages` first)."""
        c = self.cache
        layers = self.layers(slot)
        if not layers:
            return
        c.pool = self._copy_in(c.pool, slot, layers, len(c.slot_tokens[slot]))
        del c.offloaded[slot]
        self._check()

    # ------------------------------------------------------------------ inside a step

    def bring(self, slot: int, layer: int, tokens: int, pool: KVPages) -> KVPages:
        """Before layer `layer` of a step after which `slot` holds `tokens` tokens: its
        pages for all of them, the host copy written in; returns the pool."""
        return self._copy_in(pool, slot, [layer], tokens)

    def send(self, slot: int, layer: int, tokens: int, pool: KVPages) -> None:
        """After layer `layer` of that step: its new full pages copied out, its own pages
        freed (the host copy now holds every full block of it)."""
        c = self.cache
        h = c.offloaded[slot][layer]
        self._copy_out(pool, slot, layer, h, tokens // c.page_size)
        c.free, c.tables = drop_layers(c.free, c.tables, jnp.int32(slot), self._mask([layer]),
                                       jnp.int32(h.first))
        c.free_pages += self._own_pages(slot, h.first, tokens)

    def step_pages(self, lengths: dict[int, int]) -> int:
        """The most pages a step's `bring`s hold at once: one layer's of every row with that
        layer offloaded (`lengths`: the rows' slots and their lengths after the step)."""
        c = self.cache
        per_layer = np.zeros(c.num_layers, np.int64)
        for slot, n in lengths.items():
            for layer, h in c.offloaded.get(slot, {}).items():
                per_layer[layer] += self._own_pages(slot, h.first, n)
        return int(per_layer.max(initial=0))

    def settle(self) -> None:
        """After a step: hold every host copy as host arrays in power-of-two runs (the
        device copies made in the step are freed; a decode step adds a block at a time)."""
        self._check()
        for held in self.cache.offloaded.values():
            for h in held.values():
                if all(isinstance(p.k, np.ndarray) for p in h.parts) and len(h.parts) <= len(
                        power_of_two_runs(h.blocks)):
                    continue
                whole = jax.tree.map(lambda *xs: np.concatenate(xs),
                                     *jax.device_get(h.parts))
                h.parts = [jax.tree.map(lambda x, a=a, b=b: x[a:b], whole)
                           for a, b in power_of_two_runs(h.blocks)]

    def _check(self) -> None:
        oks, self._unchecked = self._unchecked, []
        if not all(jax.device_get(oks)):
            raise RuntimeError("page reservation failed although the host count allowed it")

    # ------------------------------------------------------------------ copies

    def _copy_out(self, pool: KVPages, slot: int, layer: int, h: HostLayer,
                  full: int) -> None:
        """Append blocks [first + h.blocks, full) of (slot, layer) to `h`, as device copies
        on their way to the host."""
        c = self.cache
        start = h.first + h.blocks
        for a, b in power_of_two_runs(max(full - start, 0)):
            ids = layer_page_ids(c.tables.pages, jnp.int32(slot), jnp.int32(layer),
                                 jnp.int32(start + a), count=b - a)
            part = gather_pages(pool, ids)
            for x in part.arrays().values():
                x.copy_to_host_async()
            h.parts.append(part)
            self.offloaded_bytes += part.nbytes

    def _copy_in(self, pool: KVPages, slot: int, layers: Sequence[int],
                 tokens: int) -> KVPages:
        """Give (slot, layer) for each of `layers` the pages to hold `tokens` tokens and
        write its host copy into them."""
        c = self.cache
        need = sum(self._own_pages(slot, c.offloaded[slot][x].first, tokens) for x in layers)
        if not c.make_room(need):
            raise RuntimeError(f"bringing back {len(layers)} layers of slot {slot} needs "
                               f"{need} pages and only {c.available_pages} can be had")
        c.free, c.tables, ok = grow_layers(c.free, c.tables, jnp.int32(slot),
                                           self._mask(layers), jnp.int32(tokens))
        c.free_pages -= need
        for layer in layers:
            h = c.offloaded[slot][layer]
            start = h.first
            for part in h.parts:
                k = part.k.shape[0]
                ids = layer_page_ids(c.tables.pages, jnp.int32(slot), jnp.int32(layer),
                                     jnp.int32(start), count=k)
                pool = scatter_pages(pool, ids, jax.device_put(part))
                self.fetched_bytes += part.nbytes
                start += k
        self._unchecked.append(ok)
        return pool
