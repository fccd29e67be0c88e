"""Device calls that move one layer of a slot between the pool and the host: its pages
dropped from its table row (`drop_layers`), copied out (`copy_layer_out`), or taken again
with its host copy written in (`bring_layer`). The manager runs the calls that change the free
list and tables; `layer_offload.LayerOffload` keeps the host copies."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jkv.kv.allocator import FreeList, PageTables, reserve, unref
from jkv.kv.pages import NULL_PAGE, KVPages


def _row_ids(tables: PageTables, slot: jax.Array, layer: jax.Array, first: jax.Array,
             count: int) -> jax.Array:
    """Page ids of table columns [first, first + count) of (slot, layer) as [count, KV
    heads]; columns past the row's pages read as the null page."""
    cols = first + jnp.arange(count)
    row = tables.pages[slot, layer]  # [H, W]
    ids = jnp.take(row, cols, axis=-1, mode="fill", fill_value=NULL_PAGE)
    return jnp.where(cols < tables.num_pages[slot, layer][:, None], ids, NULL_PAGE).T


def _layer_mask(tables: PageTables, layers: jax.Array) -> jax.Array:
    """bool [L] from one layer index or a bool mask."""
    if layers.dtype == jnp.bool_:
        return layers
    return jnp.arange(tables.num_pages.shape[1]) == layers


def _drop(free: FreeList, tables: PageTables, slot: jax.Array, layers: jax.Array,
          first: jax.Array) -> tuple[FreeList, PageTables]:
    layers = _layer_mask(tables, layers)
    row, held = tables.pages[slot], tables.num_pages[slot]  # [L, H, W], [L, H]
    j = jnp.arange(row.shape[-1])
    drop = layers[:, None, None] & (j >= first) & (j < held[..., None])
    return unref(free, jnp.where(drop, row, NULL_PAGE)), tables.replace(
        pages=tables.pages.at[slot].set(jnp.where(drop, NULL_PAGE, row)),
        num_pages=tables.num_pages.at[slot].set(
            jnp.where(layers[:, None], jnp.minimum(held, first), held)))


@jax.jit
def drop_layers(free: FreeList, tables: PageTables, slot: jax.Array, layers: jax.Array,
                first: jax.Array) -> tuple[FreeList, PageTables]:
    """Drop the entries of `slot`'s rows of `layers` (bool [L], or one layer index: -1 for
    none) from column `first` on: their references go, pages no one else holds are freed;
    the rows keep `first` pages."""
    return _drop(free, tables, slot, layers, first)


@partial(jax.jit, static_argnames="count")
def copy_layer_out(pool: KVPages, tables: PageTables, slot: jax.Array, layer: jax.Array,
                   start: jax.Array, count: int) -> KVPages:
    """The pages of table columns [start, start + count) of (slot, layer): [count, KV heads,
    ...] (columns past the row's pages: the null page's contents)."""
    return pool.take(_row_ids(tables, slot, layer, start, count))


@partial(jax.jit, donate_argnums=2)
def bring_layer(free: FreeList, tables: PageTables, pool: KVPages, args: jax.Array,
                pages: KVPages) -> tuple[FreeList, PageTables, KVPages, jax.Array]:
    """Give (slot, layer) the pages to hold `tokens` tokens and write `pages` (its host
    copy with blocks and KV heads on one axis, `join_leading`: [capacity * KV heads, ...],
    the first `blocks` blocks real) into columns [first, first + blocks): one call per
    layer. `args`: int32 [8], (slot, layer, tokens, first, blocks) and, first of all, a
    layer sent out before it to drop as `drop_layers` does (its slot, layer (-1: none) and
    first column): the step makes one call where it would make two, and copies its
    arguments to the device once. Returns (free, tables, pool, ok) as `reserve` does."""
    slot, layer, tokens, first, blocks = args[0], args[1], args[2], args[3], args[4]
    free, tables = _drop(free, tables, args[5], args[6], args[7])
    s, n_layers, heads = tables.num_pages.shape
    mask = jnp.arange(n_layers) == layer
    want = jnp.zeros((s, n_layers, heads), jnp.int32).at[slot].set(
        jnp.where(mask[:, None], tokens, 0))
    free, tables, ok = reserve(free, tables, jnp.zeros((s,), jnp.int32), want)
    ids = _row_ids(tables, slot, layer, first, pages.k.shape[0] // heads)
    ids = jnp.where((jnp.arange(ids.shape[0]) < blocks)[:, None], ids, NULL_PAGE)
    return free, tables, pool.put(ids.reshape(-1), pages), ok
