"""Device page pool and per-(sequence, layer, KV head) page tables.

A page holds `page_size` tokens of one KV head of one layer. Free page ids sit in one
circular array; a batch of allocations is an exclusive prefix sum over per-(slot, layer,
head) needs, and a release appends the freed ids the same way (DESIGN.md: allocation happens
on the device, no per-head Python loop). Page 0 is the null page: empty table entries point
at it and writes of padding tokens land there, so it is never handed out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

NULL_PAGE = 0


@struct.dataclass
class PagePool:
    """The pages themselves. Kept apart from the free list so that allocating never touches
    (or copies) the KV data."""

    k: jax.Array  # [num_pages, page_size, head_dim]; page 0 is the null page
    v: jax.Array  # [num_pages, page_size, head_dim]

    @property
    def page_size(self) -> int:
        return self.k.shape[1]


@struct.dataclass
class FreeList:
    ids: jax.Array  # int32[num_pages - 1]: circular list of free page ids
    head: jax.Array  # int32[]: index in ids of the next id to hand out
    num_free: jax.Array  # int32[]: how many ids from head on are free
    page_size: int = struct.field(pytree_node=False)


@struct.dataclass
class PageTables:
    pages: jax.Array  # int32[max_seqs, num_layers, num_kv_heads, max_pages]; 0 = no page
    num_pages: jax.Array  # int32[max_seqs, num_layers, num_kv_heads]
    lengths: jax.Array  # int32[max_seqs]: tokens held by each sequence slot


def init_pool(num_pages: int, page_size: int, head_dim: int,
              dtype=jnp.bfloat16) -> tuple[PagePool, FreeList]:
    """An empty pool of `num_pages` pages (one of them the null page) and its free list."""
    if num_pages < 2:
        raise ValueError(f"num_pages must be at least 2 (one is the null page), got {num_pages}")
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    shape = (num_pages, page_size, head_dim)
    pool = PagePool(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
    free = FreeList(ids=jnp.arange(1, num_pages, dtype=jnp.int32), head=jnp.zeros((), jnp.int32),
                    num_free=jnp.asarray(num_pages - 1, jnp.int32), page_size=page_size)
    return pool, free


def init_tables(max_seqs: int, num_layers: int, num_kv_heads: int, max_pages: int) -> PageTables:
    """Page tables for `max_seqs` empty sequence slots."""
    return PageTables(
        pages=jnp.zeros((max_seqs, num_layers, num_kv_heads, max_pages), jnp.int32),
        num_pages=jnp.zeros((max_seqs, num_layers, num_kv_heads), jnp.int32),
        lengths=jnp.zeros((max_seqs,), jnp.int32),
    )


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    flat = x.reshape(-1)
    return (jnp.cumsum(flat) - flat).reshape(x.shape)


@jax.jit
def reserve(free: FreeList, tables: PageTables,
            new_lengths: jax.Array) -> tuple[FreeList, PageTables, jax.Array]:
    """Grow each slot to hold `new_lengths` [max_seqs] tokens, allocating pages as needed.

    Slots whose new length is not larger keep what they have. Returns (free, tables, ok);
    when the pool is short or a length exceeds the table width nothing changes and ok is False.
    """
    page_size = free.page_size
    max_pages = tables.pages.shape[-1]
    lengths = jnp.maximum(tables.lengths, new_lengths.astype(jnp.int32))
    want = (lengths + page_size - 1) // page_size  # [S]
    need = jnp.maximum(want[:, None, None] - tables.num_pages, 0)  # [S, L, H]
    offsets = _exclusive_cumsum(need)
    total = need.sum()
    ok = (total <= free.num_free) & (want.max() <= max_pages)

    j = jnp.arange(max_pages, dtype=jnp.int32)
    k = j - tables.num_pages[..., None]  # index of page j among the new ones
    take = (k >= 0) & (k < need[..., None]) & ok
    n_ids = free.ids.shape[0]
    ids = free.ids[(free.head + offsets[..., None] + k) % n_ids]
    pages = jnp.where(take, ids, tables.pages)

    total = jnp.where(ok, total, 0)
    new_free = free.replace(head=(free.head + total) % n_ids, num_free=free.num_free - total)
    new_tables = PageTables(
        pages=pages,
        num_pages=jnp.where(ok, tables.num_pages + need, tables.num_pages),
        lengths=jnp.where(ok, lengths, tables.lengths),
    )
    return new_free, new_tables, ok


@jax.jit
def release(free: FreeList, tables: PageTables,
            mask: jax.Array) -> tuple[FreeList, PageTables]:
    """Return every page of the slots where `mask` [max_seqs] is set to the free list."""
    max_pages = tables.pages.shape[-1]
    count = jnp.where(mask[:, None, None], tables.num_pages, 0)  # [S, L, H]
    offsets = _exclusive_cumsum(count)
    n_ids = free.ids.shape[0]
    tail = free.head + free.num_free
    j = jnp.arange(max_pages, dtype=jnp.int32)
    give = j < count[..., None]
    dest = jnp.where(give, (tail + offsets[..., None] + j) % n_ids, n_ids)  # n_ids: dropped
    ids = free.ids.at[dest.reshape(-1)].set(tables.pages.reshape(-1), mode="drop")
    new_free = free.replace(ids=ids, num_free=free.num_free + count.sum())
    m3 = mask[:, None, None]
    new_tables = PageTables(
        pages=jnp.where(m3[..., None], NULL_PAGE, tables.pages),
        num_pages=jnp.where(m3, 0, tables.num_pages),
        lengths=jnp.where(mask, 0, tables.lengths),
    )
    return new_free, new_tables


def write_kv(k_pool: jax.Array, v_pool: jax.Array, pages: jax.Array, k_new: jax.Array,
             v_new: jax.Array, positions: jax.Array,
             valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatter one layer's new K/V [B, T, H, D] at `positions` [B, T] into its pages.

    `pages` [B, H, W] is that layer's page table; tokens where `valid` is False go to the
    null page. Pure function: call it inside a jit that donates the pools.
    """
    page_size = k_pool.shape[1]
    b, t, h, _ = k_new.shape
    slot = positions // page_size  # [B, T]
    width = pages.shape[-1]
    slot = jnp.clip(slot, 0, width - 1)
    page_ids = jnp.take_along_axis(
        pages, jnp.broadcast_to(slot[:, None, :], (b, h, t)), axis=2)  # [B, H, T]
    page_ids = jnp.where(valid[:, None, :], page_ids, NULL_PAGE)
    offs = jnp.broadcast_to((positions % page_size)[:, None, :], (b, h, t))
    k_vals = jnp.swapaxes(k_new, 1, 2).astype(k_pool.dtype)  # [B, H, T, D]
    v_vals = jnp.swapaxes(v_new, 1, 2).astype(v_pool.dtype)
    k_pool = k_pool.at[page_ids, offs].set(k_vals)
    v_pool = v_pool.at[page_ids, offs].set(v_vals)
    return k_pool, v_pool

