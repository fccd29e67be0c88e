"""Device page pool and per-(sequence, layer, KV head) page tables.

A page holds `page_size` tokens of one KV head of one layer, in the pool's `KVFormat`: model
dtype, or packed integer codes with scales and zero points beside them (`kv_quant`). The
page a sequence is filling stays in full precision in `FillingPages` until it is full and is
then quantized as a unit (KIVI/LeanKV's recent window). Free page ids sit in one
circular array; a batch of allocations is an exclusive prefix sum over per-(slot, layer,
head) needs, and a release appends the freed ids the same way (DESIGN.md: allocation happens
on the device, no per-head Python loop). Page 0 is the null page: empty table entries point
at it and writes of padding tokens land there, so it is never handed out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jkv.config import KVFormat

NULL_PAGE = 0


@struct.dataclass
class PagePool:
    """The pages themselves. Kept apart from the free list so that allocating never touches
    (or copies) the KV data. Scales and zero points are None on a side kept in model dtype."""

    k: jax.Array  # [P, page, D // (8 // k_bits)] uint8 codes, or [P, page, D] model dtype
    v: jax.Array  # [P, page, D // (8 // v_bits)] uint8 codes, or [P, page, D] model dtype
    k_scale: jax.Array | None = None  # f32 [P, D]: per (page, channel)
    k_zero: jax.Array | None = None  # f32 [P, D]
    v_scale: jax.Array | None = None  # f32 [P, page, D // group]: per (token, group)
    v_zero: jax.Array | None = None  # f32 [P, page, D // group]
    kv_format: KVFormat = struct.field(pytree_node=False, default=KVFormat())

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    @property
    def head_dim(self) -> int:
        bits = self.kv_format.k_bits
        return self.k.shape[-1] * (8 // bits if bits < 16 else 1)

    @property
    def group(self) -> int:
        """Channels per value scale: the format's group, capped at head_dim."""
        return min(self.kv_format.group, self.head_dim)


@struct.dataclass
class FillingPages:
    """The page each (sequence slot, layer, KV head) is filling, in model dtype: tokens
    [page_size * (length // page_size), length) of the sequence."""

    k: jax.Array  # [S, L, Hkv, page, D]
    v: jax.Array  # [S, L, Hkv, page, D]


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


def page_bytes(kv_format: KVFormat, page_size: int, head_dim: int, dtype) -> int:
    """Bytes one page takes in the pool, scales and zero points included."""
    per_token = kv_format.bytes_per_token(head_dim, jnp.dtype(dtype).itemsize)
    return int(page_size * per_token) + kv_format.key_page_overhead_bytes(head_dim)


def init_pool(num_pages: int, page_size: int, head_dim: int, dtype=jnp.bfloat16,
              kv_format: KVFormat | None = None) -> tuple[PagePool, FreeList]:
    """An empty pool of `num_pages` pages (one of them the null page) and its free list."""
    if num_pages < 2:
        raise ValueError(f"num_pages must be at least 2 (one is the null page), got {num_pages}")
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    fmt = KVFormat() if kv_format is None else kv_format
    group = min(fmt.group, head_dim)
    for side, bits in (("k", fmt.k_bits), ("v", fmt.v_bits)):
        if bits < 16 and head_dim % (8 // bits):
            raise ValueError(f"head_dim {head_dim} does not pack into bytes at {side}_bits={bits}")
    if fmt.v_bits < 16 and head_dim % group:
        raise ValueError(f"value group {group} does not divide head_dim {head_dim}")

    def side(bits: int) -> jax.Array:
        if bits == 16:
            return jnp.zeros((num_pages, page_size, head_dim), dtype)
        return jnp.zeros((num_pages, page_size, head_dim * bits // 8), jnp.uint8)

    pool = PagePool(k=side(fmt.k_bits), v=side(fmt.v_bits), kv_format=fmt)
    if fmt.k_bits < 16:
        pool = pool.replace(k_scale=jnp.zeros((num_pages, head_dim), jnp.float32),
                            k_zero=jnp.zeros((num_pages, head_dim), jnp.float32))
    if fmt.v_bits < 16:
        shape = (num_pages, page_size, head_dim // group)
        pool = pool.replace(v_scale=jnp.zeros(shape, jnp.float32),
                            v_zero=jnp.zeros(shape, jnp.float32))
    free = FreeList(ids=jnp.arange(1, num_pages, dtype=jnp.int32), head=jnp.zeros((), jnp.int32),
                    num_free=jnp.asarray(num_pages - 1, jnp.int32), page_size=page_size)
    return pool, free


def init_filling(max_seqs: int, num_layers: int, num_kv_heads: int, page_size: int,
                 head_dim: int, dtype=jnp.bfloat16) -> FillingPages:
    """Empty filling pages for `max_seqs` sequence slots."""
    shape = (max_seqs, num_layers, num_kv_heads, page_size, head_dim)
    return FillingPages(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


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
def release(free: FreeList, tables: PageTables, mask: jax.Array,
            keep: jax.Array | None = None) -> tuple[FreeList, PageTables]:
    """Empty the slots where `mask` [max_seqs] is set, returning their pages to the free list.

    keep [max_seqs, max_pages] marks table columns whose pages are not returned because
    someone else owns them now (the prefix cache); they are only dropped from the table.
    """
    max_pages = tables.pages.shape[-1]
    j = jnp.arange(max_pages, dtype=jnp.int32)
    give = mask[:, None, None, None] & (j < tables.num_pages[..., None])  # [S, L, H, W]
    if keep is not None:
        give &= ~keep[:, None, None, :]
    offsets = _exclusive_cumsum(give.astype(jnp.int32))
    n_ids = free.ids.shape[0]
    tail = free.head + free.num_free
    dest = jnp.where(give, (tail + offsets) % n_ids, n_ids)  # n_ids: dropped
    ids = free.ids.at[dest.reshape(-1)].set(tables.pages.reshape(-1), mode="drop")
    new_free = free.replace(ids=ids, num_free=free.num_free + give.sum(dtype=jnp.int32))
    m3 = mask[:, None, None]
    new_tables = PageTables(
        pages=jnp.where(m3[..., None], NULL_PAGE, tables.pages),
        num_pages=jnp.where(m3, 0, tables.num_pages),
        lengths=jnp.where(mask, 0, tables.lengths),
    )
    return new_free, new_tables


@jax.jit
def free_pages(free: FreeList, ids: jax.Array) -> FreeList:
    """Append the page ids in `ids` (any shape; entries <= 0 are skipped) to the free list."""
    flat = ids.reshape(-1)
    give = flat > NULL_PAGE
    n_ids = free.ids.shape[0]
    tail = free.head + free.num_free
    dest = jnp.where(give, (tail + jnp.cumsum(give) - give) % n_ids, n_ids)
    return free.replace(ids=free.ids.at[dest].set(flat, mode="drop"),
                        num_free=free.num_free + give.sum(dtype=jnp.int32))


@jax.jit
def export_blocks(tables: PageTables, blocks: jax.Array, slot: jax.Array,
                  rows: jax.Array) -> jax.Array:
    """Copy the page ids of column i of `slot` into row rows[i] of `blocks` [C, L, H].

    rows [max_pages] int32; a negative row skips its column. This is how a finished
    sequence's full pages become prefix-cache blocks.
    """
    ids = jnp.moveaxis(tables.pages[slot], -1, 0)  # [W, L, H]
    dest = jnp.where(rows >= 0, rows, blocks.shape[0])
    return blocks.at[dest].set(ids, mode="drop")


@jax.jit
def import_blocks(tables: PageTables, blocks: jax.Array, slot: jax.Array,
                  rows: jax.Array, count: jax.Array, length: jax.Array) -> PageTables:
    """Start the empty `slot` with the cached blocks rows[:count] as its first pages.

    rows [max_pages] int32; length = count * page_size, the tokens the slot then holds. The
    pages stay owned by the cache (release the slot with `keep` over those columns).
    """
    w = tables.pages.shape[-1]
    take = jnp.arange(w) < count
    ids = jnp.moveaxis(blocks[jnp.clip(rows, 0, blocks.shape[0] - 1)], 0, -1)  # [L, H, W]
    row = jnp.where(take, ids, NULL_PAGE)
    return PageTables(
        pages=tables.pages.at[slot].set(row),
        num_pages=tables.num_pages.at[slot].set(count),
        lengths=tables.lengths.at[slot].set(length),
    )
