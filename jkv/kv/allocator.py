"""Which page ids are free, and which tables hold which pages, with reference counts.

A page id may be referenced by several holders at once: the page-table entries of sequence
slots (two requests sharing a prefix, later two layers sharing KV) and the rows of the
device prefix cache's block array. Each holder counts once in `FreeList.refs`; a page goes
back to the free list exactly once, when its last reference is dropped, however many of
them drop in the same call. Everything here is one jitted call over whole arrays (DESIGN.md:
allocation happens on the device, no per-head Python loop): an allocation is an exclusive
prefix sum over per-(slot, layer, KV head) needs, a release appends the pages whose count
reached zero the same way.

Page 0 is the null page: empty table entries point at it and writes of padding tokens land
there, so it is never handed out and never counted.

Under tensor parallelism (`jkv.kv.sharding`) the pool is split into `groups` equal parts, one
per device, and each part has its own circular list: the pages of a group of KV heads come
from its own part, so they sit on the device that computes those heads. A part's first page
is never handed out either (the device's own null page).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jkv.kv.pages import NULL_PAGE


@struct.dataclass
class FreeList:
    """Free page ids in a circular array, and every page's reference count."""

    ids: jax.Array  # int32[num_pages - 1]: circular list of free page ids ([groups, ...])
    head: jax.Array  # int32[] ([groups]): index in ids of the next id to hand out
    num_free: jax.Array  # int32[] ([groups]): how many ids from head on are free
    refs: jax.Array  # int32[num_pages]: holders of each page (table entries, cache rows)
    page_size: int = struct.field(pytree_node=False)
    # KV-head groups, each with its own list (tensor parallelism), of `group_heads` heads
    groups: int = struct.field(pytree_node=False, default=1)
    group_heads: int = struct.field(pytree_node=False, default=1)


@struct.dataclass
class PageTables:
    """Per (slot, layer, KV head) a row of `max_pages` page ids: `num_pages` from the left
    (in token order, or a token tier's pages: `token_tiers`) and `low_pages` from the right
    (the low tier of LeanKV's bidirectional table; 0 without tiers)."""

    pages: jax.Array  # int32[max_seqs, num_layers, num_kv_heads, max_pages]; 0 = no page
    num_pages: jax.Array  # int32[max_seqs, num_layers, num_kv_heads]
    lengths: jax.Array  # int32[max_seqs]: tokens held by each sequence slot
    low_pages: jax.Array  # int32[max_seqs, num_layers, num_kv_heads]


def init_free(num_pages: int, page_size: int, groups: int = 1,
              group_heads: int = 1) -> FreeList:
    """Every page but the null page free, none referenced. `groups` > 1: the pages split
    into that many equal parts, one list each, for groups of `group_heads` KV heads."""
    if num_pages < 2 * groups:
        raise ValueError(f"num_pages must be at least 2 (one is the null page) per group, got "
                         f"{num_pages}" + (f" for {groups} groups" if groups > 1 else ""))
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if groups > 1:
        if num_pages % groups:
            raise ValueError(f"num_pages ({num_pages}) must split into {groups} equal groups")
        per = num_pages // groups
        ids = jnp.arange(groups, dtype=jnp.int32)[:, None] * per + jnp.arange(1, per,
                                                                             dtype=jnp.int32)
        return FreeList(ids=ids, head=jnp.zeros((groups,), jnp.int32),
                        num_free=jnp.full((groups,), per - 1, jnp.int32),
                        refs=jnp.zeros((num_pages,), jnp.int32), page_size=page_size,
                        groups=groups, group_heads=group_heads)
    return FreeList(ids=jnp.arange(1, num_pages, dtype=jnp.int32), head=jnp.zeros((), jnp.int32),
                    num_free=jnp.asarray(num_pages - 1, jnp.int32),
                    refs=jnp.zeros((num_pages,), jnp.int32), page_size=page_size)


def init_tables(max_seqs: int, num_layers: int, num_kv_heads: int, max_pages: int) -> PageTables:
    """Page tables for `max_seqs` empty sequence slots."""
    return PageTables(
        pages=jnp.zeros((max_seqs, num_layers, num_kv_heads, max_pages), jnp.int32),
        num_pages=jnp.zeros((max_seqs, num_layers, num_kv_heads), jnp.int32),
        lengths=jnp.zeros((max_seqs,), jnp.int32),
        low_pages=jnp.zeros((max_seqs, num_layers, num_kv_heads), jnp.int32),
    )


def held_mask(tables: PageTables) -> jax.Array:
    """Which table entries hold a page: bool [..., max_pages] (left and right sides)."""
    w = tables.pages.shape[-1]
    j = jnp.arange(w, dtype=jnp.int32)
    return (j < tables.num_pages[..., None]) | (j >= w - tables.low_pages[..., None])


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    flat = x.reshape(-1)
    return (jnp.cumsum(flat) - flat).reshape(x.shape)


def add_refs(free: FreeList, ids: jax.Array, delta: int) -> FreeList:
    """refs[id] += delta for every entry of `ids` > 0 (repeats count once each)."""
    flat = ids.reshape(-1)
    dest = jnp.where(flat > NULL_PAGE, flat, free.refs.shape[0])
    return free.replace(refs=free.refs.at[dest].add(delta, mode="drop"))


def unref(free: FreeList, ids: jax.Array) -> FreeList:
    """Drop one reference per entry of `ids` > 0; pages left with none join the free list
    (once each, however many of their references went in this call)."""
    n_pages = free.refs.shape[0]
    flat = ids.reshape(-1)
    dest = jnp.where(flat > NULL_PAGE, flat, n_pages)
    refs = free.refs.at[dest].add(-1, mode="drop")
    touched = jnp.zeros((n_pages,), bool).at[dest].set(True, mode="drop")
    freed = touched & (refs == 0)
    if free.groups > 1:
        return _free_grouped(free, refs, freed)
    n_ids = free.ids.shape[0]
    tail = free.head + free.num_free
    offsets = jnp.cumsum(freed) - freed
    slots = jnp.where(freed, (tail + offsets) % n_ids, n_ids)
    ids_out = free.ids.at[slots].set(jnp.arange(n_pages, dtype=jnp.int32), mode="drop")
    return free.replace(ids=ids_out, refs=refs,
                        num_free=free.num_free + freed.sum(dtype=jnp.int32))


def _free_grouped(free: FreeList, refs: jax.Array, freed: jax.Array) -> FreeList:
    """`unref`'s freed pages (bool [num_pages]) appended to their own group's list."""
    g = free.groups
    freed = freed.reshape(g, -1)  # [groups, pages of a group]
    n_ids = free.ids.shape[1]
    offsets = jnp.cumsum(freed, axis=1) - freed
    slots = jnp.where(freed, ((free.head + free.num_free)[:, None] + offsets) % n_ids, n_ids)
    pages = jnp.arange(refs.shape[0], dtype=jnp.int32).reshape(g, -1)
    ids = free.ids.at[jnp.arange(g)[:, None], slots].set(pages, mode="drop")
    return free.replace(ids=ids, refs=refs,
                        num_free=free.num_free + freed.sum(axis=1, dtype=jnp.int32))


def _allocate_grouped(free: FreeList, need: jax.Array,
                      width: int) -> tuple[FreeList, jax.Array, jax.Array]:
    """`allocate` with a list per group: each row takes its pages from its KV head's group.
    Every caller's rows are [..., KV heads], so a row's head is its index mod the heads."""
    g, gh = free.groups, free.group_heads
    if need.size % (g * gh):
        raise ValueError(f"need {list(need.shape)} has no whole KV-head axis of {g * gh}")
    by_group = need.astype(jnp.int32).reshape(-1, g, gh).swapaxes(0, 1).reshape(g, -1)
    offsets = jnp.cumsum(by_group, axis=1) - by_group
    total = by_group.sum(axis=1)
    ok = jnp.all(total <= free.num_free)
    k = jnp.arange(width, dtype=jnp.int32)
    take = (k < by_group[..., None]) & ok
    n_ids = free.ids.shape[1]
    at = (free.head[:, None, None] + offsets[..., None] + k) % n_ids
    ids = jnp.where(take, free.ids[jnp.arange(g)[:, None, None], at], NULL_PAGE)
    ids = ids.reshape(g, -1, gh, width).swapaxes(0, 1).reshape(*need.shape, width)
    total = jnp.where(ok, total, 0)
    new_free = add_refs(free, ids, 1)
    return new_free.replace(head=(free.head + total) % n_ids,
                            num_free=free.num_free - total), ids, ok


def free_count(num_free: np.ndarray | int) -> int:
    """Pages the host may count as free from the device's `num_free`: with KV-head groups,
    the emptiest group's times the groups (a layout whose heads hold unequal numbers of
    pages can leave the groups unequal; block pages never do)."""
    num_free = np.asarray(num_free)
    return int(num_free.min()) * num_free.size


def allocate(free: FreeList, need: jax.Array, width: int) -> tuple[FreeList, jax.Array, jax.Array]:
    """need [...] new pages per row from the head of the circular list, each referenced once:
    (free, ids [..., width] with the k-th new id of a row at k < need, else the null page, ok).
    When the list is short nothing is taken and ok is False."""
    if free.groups > 1:
        return _allocate_grouped(free, need, width)
    need = need.astype(jnp.int32)
    offsets = _exclusive_cumsum(need)
    total = need.sum()
    ok = total <= free.num_free
    k = jnp.arange(width, dtype=jnp.int32)
    take = (k < need[..., None]) & ok
    n_ids = free.ids.shape[0]
    ids = jnp.where(take, free.ids[(free.head + offsets[..., None] + k) % n_ids], NULL_PAGE)
    total = jnp.where(ok, total, 0)
    new_free = add_refs(free, ids, 1)
    return new_free.replace(head=(free.head + total) % n_ids,
                            num_free=free.num_free - total), ids, ok


@jax.jit
def reserve(free: FreeList, tables: PageTables, new_lengths: jax.Array,
            head_tokens: jax.Array | None = None) -> tuple[FreeList, PageTables, jax.Array]:
    """Grow slots to `new_lengths` [max_seqs] tokens, allocating pages as needed.

    `head_tokens` [max_seqs, layers, KV heads] says how many of them each (layer, KV head)
    keeps in its left-side pages (default: all of them), so heads may own different numbers
    of pages. Nothing shrinks. Returns (free, tables, ok); when the pool is short or a head
    would run into its right-side pages (or past the table width) nothing changes and ok is
    False.
    """
    page_size = free.page_size
    max_pages = tables.pages.shape[-1]
    lengths = jnp.maximum(tables.lengths, new_lengths.astype(jnp.int32))
    if head_tokens is None:
        head_tokens = jnp.broadcast_to(lengths[:, None, None], tables.num_pages.shape)
    want = jnp.maximum((head_tokens.astype(jnp.int32) + page_size - 1) // page_size,
                       tables.num_pages)  # [S, L, H]
    fits = (want + tables.low_pages).max() <= max_pages
    need = jnp.where(fits, want - tables.num_pages, 0)
    new_free, ids, ok = allocate(free, need, max_pages)
    ok = ok & fits
    k = jnp.arange(max_pages, dtype=jnp.int32) - tables.num_pages[..., None]
    take = (k >= 0) & (k < need[..., None]) & ok
    pages = jnp.where(take, jnp.take_along_axis(ids, jnp.clip(k, 0, max_pages - 1), -1),
                      tables.pages)
    new_tables = tables.replace(
        pages=pages,
        num_pages=jnp.where(ok, want, tables.num_pages),
        lengths=jnp.where(ok, lengths, tables.lengths),
    )
    return new_free, new_tables, ok


@jax.jit
def release(free: FreeList, tables: PageTables,
            mask: jax.Array) -> tuple[FreeList, PageTables]:
    """Empty the slots where `mask` [max_seqs] is set: each of their table entries drops its
    reference, and pages no one else holds go back to the free list."""
    held = mask[:, None, None, None] & held_mask(tables)  # [S, L, H, W]
    new_free = unref(free, jnp.where(held, tables.pages, NULL_PAGE))
    m3 = mask[:, None, None]
    new_tables = PageTables(
        pages=jnp.where(m3[..., None], NULL_PAGE, tables.pages),
        num_pages=jnp.where(m3, 0, tables.num_pages),
        lengths=jnp.where(mask, 0, tables.lengths),
        low_pages=jnp.where(m3, 0, tables.low_pages),
    )
    return new_free, new_tables


@jax.jit
def export_blocks(free: FreeList, tables: PageTables, blocks: jax.Array, slot: jax.Array,
                  rows: jax.Array) -> tuple[FreeList, jax.Array]:
    """Copy the page ids of table column i of `slot` into row rows[i] of `blocks` [C, L, H],
    each a new reference (rows [max_pages] int32; a negative row skips its column). This is
    how a sequence's full pages become prefix-cache blocks; rows must be empty ones."""
    ids = jnp.moveaxis(tables.pages[slot], -1, 0)  # [W, L, H]
    take = (rows >= 0)[:, None, None]
    dest = jnp.where(rows >= 0, rows, blocks.shape[0])
    return (add_refs(free, jnp.where(take, ids, NULL_PAGE), 1),
            blocks.at[dest].set(ids, mode="drop"))


@jax.jit
def import_blocks(free: FreeList, tables: PageTables, blocks: jax.Array, slot: jax.Array,
                  rows: jax.Array, count: jax.Array,
                  length: jax.Array) -> tuple[FreeList, PageTables]:
    """Start the empty `slot` with the cached blocks rows[:count] as its first pages, each
    entry a new reference (rows [max_pages] int32; length = count * page_size)."""
    w = tables.pages.shape[-1]
    take = jnp.arange(w) < count
    ids = jnp.moveaxis(blocks[jnp.clip(rows, 0, blocks.shape[0] - 1)], 0, -1)  # [L, H, W]
    row = jnp.where(take, ids, NULL_PAGE)
    new_tables = tables.replace(
        pages=tables.pages.at[slot].set(row),
        num_pages=tables.num_pages.at[slot].set(count),
        lengths=tables.lengths.at[slot].set(length),
    )
    return add_refs(free, row, 1), new_tables


@jax.jit
def drop_blocks(free: FreeList, blocks: jax.Array, rows: jax.Array) -> tuple[FreeList, jax.Array]:
    """Empty prefix-cache rows `rows` (int32, any shape; negative: none): their references
    drop, and pages no table holds go back to the free list."""
    safe = jnp.clip(rows, 0, blocks.shape[0] - 1)
    ids = jnp.where((rows >= 0)[..., None, None], blocks[safe], NULL_PAGE)
    dest = jnp.where(rows >= 0, rows, blocks.shape[0])
    return unref(free, ids), blocks.at[dest].set(NULL_PAGE, mode="drop")
