"""Ended token-tier sequences kept on the device for their conversation's next turn.

Token tiers (LeanKV and the pruning baselines) cannot go into the block prefix cache: a
block of a token-tier row is not a page of tokens, each (layer, KV head) keeps its own tokens in
its own tiers. So when a token-tier sequence ends (finished or preempted), its page-table row and
tier counts move whole into an *entry* row here (`move_row`: no page is copied, no reference
changes hands), keyed by the chained hash of its full pages' tokens. A later prompt that
starts with exactly those tokens (the next turn of a chat, a preempted request resuming)
opens with a copy of the entry (`adopt`): new pages holding the same bytes and token
metadata, so the conversation keeps its compression and the follow-up's own demotions and
pruning never touch the entry. Two requests opened from one entry therefore start from the
same tiers. An entry covers the sequence's full pages only; the tokens of its filling page
are computed again.

A prompt that shares all but the last few of the entry's blocks (`CUT_BLOCKS`: a chat
client resends a reply cut by max_tokens re-tokenized, or with its end token where the model
had gone on) opens with the copy cut back to the blocks it shares (`truncate`: every token at
a later position pruned from both tiers), so an entry is found by its last blocks' hashes,
not only its last. The tokens kept were placed knowing the later ones' attention, as in the
entry. A prompt sharing less is computed: a larger cut costs more (and compiles for its
size), and is seldom a conversation's own next turn.

Entries are evictable like unreferenced prefix-cache blocks: their pages count as available
and are released, least recently used first, when pages run short. This module holds the
host index (`TierEntries`) and the device calls on whole arrays.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jkv.kv.allocator import FreeList, PageTables, allocate
from jkv.kv.pages import NULL_PAGE, KVPages
from jkv.kv.token_tiers import (
    KEEP,
    PRUNE,
    TierCounts,
    TokenMeta,
    compact,
    move_pages,
    move_tokens,
    read_rows,
)

CUT_BLOCKS = 4  # the most blocks a copy of an entry is cut by


@dataclass
class Entry:
    """One kept sequence: the chained hashes of its full pages' blocks, its tokens (full
    pages only), the pages it holds and its tier counts [layers, KV heads]."""

    hashes: tuple[bytes, ...]
    tokens: int
    pages: int
    high: np.ndarray
    low: np.ndarray

    @property
    def key(self) -> bytes:
        """The hash of its last block: names its tokens (one entry per key)."""
        return self.hashes[-1]


class TierEntries:
    """Host index of `rows` entry rows: which hash each holds, in least recently used order."""

    def __init__(self, rows: int) -> None:
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self.rows = rows
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._by_key: dict[bytes, int] = {}
        self._holders: dict[bytes, set[int]] = {}  # block hash -> the rows holding it
        self._spare = list(range(rows - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, row: int) -> bool:
        return row in self._entries

    @property
    def pages(self) -> int:
        """Pages every entry holds (all of them evictable)."""
        return sum(e.pages for e in self._entries.values())

    def get(self, row: int) -> Entry:
        return self._entries[row]

    def lookup(self, hashes: Sequence[bytes], slack: int = 0) -> tuple[int, int] | None:
        """(row, blocks): an entry holding the most of a prompt's leading blocks (chained
        hashes: one that holds block i holds blocks 0..i) and at most `slack` blocks more,
        the shortest such; None without one."""
        for i in range(len(hashes) - 1, -1, -1):
            rows = [r for r in self._holders.get(hashes[i], ())
                    if len(self._entries[r].hashes) <= i + 1 + slack]
            if rows:
                return min(rows, key=lambda r: (self._entries[r].tokens, r)), i + 1
        return None

    def row_of(self, key: bytes) -> int | None:
        return self._by_key.get(key)

    def touch(self, row: int) -> None:
        self._entries.move_to_end(row)

    def oldest(self, keep: int | None = None) -> int | None:
        """The least recently used row other than `keep`; None when there is none."""
        return next((r for r in self._entries if r != keep), None)

    def spare_row(self) -> int | None:
        return self._spare[-1] if self._spare else None

    def add(self, row: int, entry: Entry) -> None:
        """Record `entry` in the spare row `row` (no entry of the same key may be kept)."""
        if entry.key in self._by_key:
            raise ValueError("an entry with this key is kept already")
        self._spare.remove(row)
        self._entries[row] = entry
        self._by_key[entry.key] = row
        for h in entry.hashes:
            self._holders.setdefault(h, set()).add(row)

    def remove(self, row: int) -> Entry:
        entry = self._entries.pop(row)
        if self._by_key.get(entry.key) == row:
            del self._by_key[entry.key]
        for h in entry.hashes:
            rows = self._holders[h]
            rows.discard(row)
            if not rows:
                del self._holders[h]
        self._spare.append(row)
        return entry


def init_entries(rows: int, num_layers: int, num_kv_heads: int,
                 max_pages: int) -> tuple[PageTables, TierCounts]:
    """Empty entry rows: page tables and tier counts shaped like the slots'."""
    shape = (rows, num_layers, num_kv_heads)

    def zeros(*shape: int) -> jax.Array:  # one buffer each: they are donated together
        return jnp.zeros(shape, jnp.int32)

    return (PageTables(pages=zeros(*shape, max_pages), num_pages=zeros(*shape),
                       lengths=zeros(rows), low_pages=zeros(*shape)),
            TierCounts(high=zeros(*shape), low=zeros(*shape)))


def _move_row(dst: PageTables, dst_counts: TierCounts, i: jax.Array, src: PageTables,
              src_counts: TierCounts, j: jax.Array) -> tuple[PageTables, TierCounts]:
    """dst's row i set to src's row j."""
    tables = PageTables(pages=dst.pages.at[i].set(src.pages[j]),
                        num_pages=dst.num_pages.at[i].set(src.num_pages[j]),
                        lengths=dst.lengths.at[i].set(src.lengths[j]),
                        low_pages=dst.low_pages.at[i].set(src.low_pages[j]))
    return tables, TierCounts(high=dst_counts.high.at[i].set(src_counts.high[j]),
                              low=dst_counts.low.at[i].set(src_counts.low[j]))


def _clear_row(tables: PageTables, counts: TierCounts,
               i: jax.Array) -> tuple[PageTables, TierCounts]:
    return (PageTables(pages=tables.pages.at[i].set(NULL_PAGE),
                       num_pages=tables.num_pages.at[i].set(0),
                       lengths=tables.lengths.at[i].set(0),
                       low_pages=tables.low_pages.at[i].set(0)),
            TierCounts(high=counts.high.at[i].set(0), low=counts.low.at[i].set(0)))


@partial(jax.jit, donate_argnums=(0, 1, 2, 3))
def move_row(src: PageTables, src_counts: TierCounts, dst: PageTables, dst_counts: TierCounts,
             i: jax.Array, j: jax.Array, tokens: jax.Array) -> tuple[
                 PageTables, TierCounts, PageTables, TierCounts]:
    """Row i of (src, src_counts) moved to the empty row j of (dst, dst_counts), which
    holds its first `tokens` tokens: its pages with their references, its tier counts; row
    i ends empty. A slot to an entry row (a sequence kept) or back (an entry taken over)."""
    dst, dst_counts = _move_row(dst, dst_counts, j, src, src_counts, i)
    dst = dst.replace(lengths=dst.lengths.at[j].set(tokens))
    src, src_counts = _clear_row(src, src_counts, i)
    return src, src_counts, dst, dst_counts


@jax.jit
def forget(entries: PageTables, entry_counts: TierCounts,
           row: jax.Array) -> tuple[PageTables, TierCounts]:
    """Entry `row` emptied, after `allocator.release` dropped its pages' references."""
    return _clear_row(entries, entry_counts, row)


@partial(jax.jit, donate_argnums=(0, 1, 2, 3, 4))
def adopt(pool: KVPages, meta: TokenMeta, free: FreeList, tables: PageTables,
          counts: TierCounts, entries: PageTables, entry_counts: TierCounts, row: jax.Array,
          slot: jax.Array) -> tuple[KVPages, TokenMeta, FreeList, PageTables, TierCounts,
                                    jax.Array]:
    """Start the empty `slot` with a copy of entry `row`: a new page for each page it holds,
    the same bytes and token metadata, at the same columns of each (layer, KV head) row,
    and the same tier counts. Returns (pool, meta, free, tables, counts, ok); when the pool
    is short nothing is taken and ok is False."""
    src = entries.pages[row]  # [L, H, W]
    high, low = entries.num_pages[row], entries.low_pages[row]
    w = src.shape[-1]
    j = jnp.arange(w, dtype=jnp.int32)
    held = (j < high[..., None]) | (j >= w - low[..., None])
    free, ids, ok = allocate(free, high + low, w)
    k = jnp.where(j < high[..., None], j, high[..., None] + (w - 1 - j))  # the k-th new id
    dst = jnp.where(held & ok, jnp.take_along_axis(ids, jnp.clip(k, 0, w - 1), -1), NULL_PAGE)
    src = jnp.where(held, src, NULL_PAGE)

    def copy_layer(layer: int, carry: tuple) -> tuple:  # one layer's pages at a time
        pool, score, pos = carry
        s, d = src[layer], dst[layer]
        to = jnp.where(d > NULL_PAGE, d, score.shape[0])
        return (pool.put(d, pool.take(s)), score.at[to].set(score[s], mode="drop"),
                pos.at[to].set(pos[s], mode="drop"))

    pool, score, pos = lax.fori_loop(0, src.shape[0], copy_layer, (pool, meta.score, meta.pos))
    tables = PageTables(pages=tables.pages.at[slot].set(dst),
                        num_pages=tables.num_pages.at[slot].set(jnp.where(ok, high, 0)),
                        lengths=tables.lengths.at[slot].set(
                            jnp.where(ok, entries.lengths[row], 0)),
                        low_pages=tables.low_pages.at[slot].set(jnp.where(ok, low, 0)))
    counts = TierCounts(
        high=counts.high.at[slot].set(jnp.where(ok, entry_counts.high[row], 0)),
        low=counts.low.at[slot].set(jnp.where(ok, entry_counts.low[row], 0)))
    return pool, TokenMeta(score=score, pos=pos), free, tables, counts, ok


@partial(jax.jit, static_argnames=("max_moves",), donate_argnums=(0, 1, 2, 3, 4))
def truncate(pool: KVPages, meta: TokenMeta, free: FreeList, tables: PageTables,
             counts: TierCounts, slot: jax.Array, tokens: jax.Array, *, max_moves: int
             ) -> tuple[KVPages, TokenMeta, FreeList, PageTables, TierCounts, jax.Array]:
    """The row in `slot` cut to its first `tokens` positions: each token at a later one
    pruned from both tiers, which end dense, their emptied pages freed (`compact`). At most
    `max_moves` (static) tokens may leave a tier of a (layer, KV head). (pool, meta, free,
    tables, counts, ok); ok False: nothing changed (a tier would lose more)."""
    page = free.page_size
    sub = PageTables(pages=tables.pages[slot][None], num_pages=tables.num_pages[slot][None],
                     lengths=tables.lengths[slot][None],
                     low_pages=tables.low_pages[slot][None])
    rows = TierCounts(high=counts.high[slot][None], low=counts.low[slot][None])
    held = read_rows(meta, sub.pages, rows, tokens, tokens, page=page, recent=0)
    fate_hi = jnp.where(held["hi_pos"] >= tokens, PRUNE, KEEP)
    fate_lo = jnp.where(held["lo_pos"] >= tokens, PRUNE, KEEP)
    free, sub, rows, moves, ok = compact(free, sub, rows, fate_hi, fate_lo, page, max_moves)
    pool, meta = move_pages(pool, moves, page), move_tokens(meta, moves)
    tables = PageTables(pages=tables.pages.at[slot].set(sub.pages[0]),
                        num_pages=tables.num_pages.at[slot].set(sub.num_pages[0]),
                        lengths=tables.lengths.at[slot].set(
                            jnp.where(ok, tokens, tables.lengths[slot])),
                        low_pages=tables.low_pages.at[slot].set(sub.low_pages[0]))
    counts = TierCounts(high=counts.high.at[slot].set(rows.high[0]),
                        low=counts.low.at[slot].set(rows.low[0]))
    return pool, meta, free, tables, counts, ok


# ---------------------------------------------------------------------- the store's form
# A token-tier row leaves the device as the pages it holds, in (layer, KV head, tier, index)
# order, with per page: its head (layer * KV heads + head), its tier (1: low), its index
# within the tier and the tokens it holds, and the token metadata of its slots. The table
# width is not part of it: an engine of another max_model_len reads it back.

TIER_ARRAYS = ("tier_head", "tier_low", "tier_index", "tier_tokens", "tier_score", "tier_pos")


def row_layout(high: np.ndarray, low: np.ndarray, page: int) -> dict[str, np.ndarray]:
    """The held pages of a row with tier counts high, low [L, H]: `tier_head`, `tier_low`,
    `tier_index` and `tier_tokens`, int32 [pages] each."""
    high, low = np.asarray(high, np.int64).ravel(), np.asarray(low, np.int64).ravel()
    per = np.stack([-(-high // page), -(-low // (2 * page))], -1).ravel()  # (head, tier)
    counts = np.stack([high, low], -1).ravel()
    head = np.repeat(np.repeat(np.arange(high.size), 2), per)
    is_low = np.repeat(np.tile([0, 1], high.size), per)
    index = np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per)
    cap = np.where(is_low == 1, 2 * page, page)
    tokens = np.minimum(cap, np.repeat(counts, per) - index * cap)
    return {name: x.astype(np.int32) for name, x in zip(
        TIER_ARRAYS[:4], (head, is_low, index, tokens), strict=True)}


def tier_counts(layout: dict[str, np.ndarray], heads: int) -> tuple[np.ndarray, np.ndarray]:
    """The tier counts [heads] a layout's pages hold (high, low)."""
    head, is_low, tokens = layout["tier_head"], layout["tier_low"], layout["tier_tokens"]
    return (np.bincount(head[is_low == 0], tokens[is_low == 0], heads).astype(np.int64),
            np.bincount(head[is_low == 1], tokens[is_low == 1], heads).astype(np.int64))


@jax.jit
def gather_row(pool: KVPages, meta: TokenMeta, tables: PageTables, slot: jax.Array,
               head: jax.Array, is_low: jax.Array, index: jax.Array) -> tuple[
                   KVPages, jax.Array, jax.Array]:
    """The pages of `slot`'s row that a layout names (padding: head -1 reads the null
    page), and their token metadata: (pages [n, ...], score, pos [n, 2 * page])."""
    w = tables.pages.shape[-1]
    rows = tables.pages[slot].reshape(-1, w)
    col = jnp.clip(jnp.where(is_low == 1, w - 1 - index, index), 0, w - 1)
    ids = jnp.where(head >= 0, rows[jnp.clip(head, 0, None), col], NULL_PAGE)
    return pool.take(ids), meta.score[ids], meta.pos[ids]


@partial(jax.jit, donate_argnums=(0, 1, 2, 3, 4))
def place_row(pool: KVPages, meta: TokenMeta, free: FreeList, tables: PageTables,
              counts: TierCounts, pages: KVPages, score: jax.Array, pos: jax.Array,
              head: jax.Array, is_low: jax.Array, index: jax.Array, high: jax.Array,
              low: jax.Array, slot: jax.Array, tokens: jax.Array) -> tuple[
                  KVPages, TokenMeta, FreeList, PageTables, TierCounts, jax.Array]:
    """Start the empty `slot` with the pages of a layout (as `gather_row` gives them; head
    -1: padding) and its tier counts high, low [L, H], holding `tokens` tokens: new pages at
    each page's column. (pool, meta, free, tables, counts, ok); nothing is taken when the
    pool is short (ok False)."""
    page = free.page_size
    w = tables.pages.shape[-1]
    hp, lp = (high + page - 1) // page, (low + 2 * page - 1) // (2 * page)
    free, ids, ok = allocate(free, hp + lp, w)
    j = jnp.arange(w, dtype=jnp.int32)
    k = jnp.where(j < hp[..., None], j, hp[..., None] + (w - 1 - j))  # the k-th new id
    held = (j < hp[..., None]) | (j >= w - lp[..., None])
    row = jnp.where(held & ok, jnp.take_along_axis(ids, jnp.clip(k, 0, w - 1), -1), NULL_PAGE)
    h = jnp.clip(head, 0, None)
    nth = jnp.where(is_low == 1, hp.reshape(-1)[h] + index, index)
    dst = jnp.where((head >= 0) & ok, ids.reshape(-1, w)[h, jnp.clip(nth, 0, w - 1)],
                    NULL_PAGE)
    to = jnp.where(dst > NULL_PAGE, dst, meta.score.shape[0])
    meta = TokenMeta(score=meta.score.at[to].set(score, mode="drop"),
                     pos=meta.pos.at[to].set(pos, mode="drop"))
    tables = PageTables(pages=tables.pages.at[slot].set(row),
                        num_pages=tables.num_pages.at[slot].set(jnp.where(ok, hp, 0)),
                        lengths=tables.lengths.at[slot].set(jnp.where(ok, tokens, 0)),
                        low_pages=tables.low_pages.at[slot].set(jnp.where(ok, lp, 0)))
    counts = TierCounts(high=counts.high.at[slot].set(jnp.where(ok, high, 0)),
                        low=counts.low.at[slot].set(jnp.where(ok, low, 0)))
    return pool.put(dst, pages), meta, free, tables, counts, ok
