"""The engine's token-tier calls, each one jitted call over whole arrays.

Before a step `grow` gives each row's high tier the pages the step's full pages' tokens
join; the step writes them and adds every key's significance (`layer_kv.attend`); after it
`retier` asks the token policy's `fates` (`jkv.policies`: LeanKV's Algorithm 1, a pruning
baseline, ...) about every (layer, KV head) of the step's rows at once, as `Placing` shows
them, then compacts (`compact`) and moves the K/V and metadata of the tokens that changed
slots. `clear` empties the tiers of ended sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jkv.kv.allocator import FreeList, PageTables
from jkv.kv.pages import KVPages
from jkv.kv.token_tiers import (
    KEEP,
    TierCounts,
    TokenMeta,
    compact,
    grow_high,
    move_pages,
    move_tokens,
    read_rows,
)


class Placement(NamedTuple):
    """A model call's placement: the rows (slot per row, scratch for none) that grew from
    `n_prev` to `n` tokens, by at most `max_moves`; by decode steps if `generation`."""

    index: np.ndarray
    n_prev: np.ndarray
    n: np.ndarray
    max_moves: int
    generation: bool


@dataclass(frozen=True)
class TierPolicy:
    """What the tiered-rows layout runs for a token policy (`jkv.policies`' `KVPolicy.tier_policy`):
    `fates` (static under jit) decides each token's tier as it leaves the newest
    `recent_window`, with `knobs` (traced); decode steps are placed every `interval` steps.
    `observation_window` > 0: significance comes from a prompt's last that many queries.
    `whole_row_moves`: a prompt chunk's placement may move every token of a row (else as
    many as the chunk's and the interval's)."""

    name: str
    fates: Callable
    recent_window: int
    interval: int = 1
    knobs: tuple[float, ...] = ()
    observation_window: int = 0
    sinks: int = 0  # first tokens a stored row's smaller forms keep (`row_forms`)
    whole_row_moves: bool = False


class Placing(NamedTuple):
    """What a token policy's `fates` decides from: rows (slot, layer, KV head) of tokens
    (`token_tiers.read_rows` reads them) that grew from `n_prev` to `n` tokens, of a prompt
    `prompt_end` tokens long; the newest `recent` of a row are never placed."""

    meta: TokenMeta
    pages: jax.Array  # [B, L, H, W] page tables
    counts: TierCounts  # [B, L, H]
    n_prev: jax.Array  # [B, 1, 1]
    n: jax.Array  # [B, 1, 1]
    prompt_end: jax.Array  # [B, 1, 1]
    page: int
    recent: int
    max_tokens: int | None
    max_moves: int  # tokens placed at most (decode steps: the interval)
    generation: bool  # grown by decode steps, else by a prompt chunk

    def rows(self, sinks: jax.Array | int = 0) -> dict:
        """The rows' tokens as `token_tiers.read_rows` gives them."""
        return read_rows(self.meta, self.pages, self.counts, self.n_prev, self.n,
                         page=self.page, recent=self.recent, sinks=sinks,
                         max_tokens=self.max_tokens)


@partial(jax.jit, donate_argnums=(0, 1, 2))
def grow(free: FreeList, tables: PageTables, counts: TierCounts, n_new: jax.Array,
         resident: jax.Array) -> tuple[FreeList, PageTables, TierCounts, jax.Array]:
    """Room for n_new [S] more tokens at the end of every high tier of each slot: (free,
    tables, counts, ok); nothing changes when the pool is short. A layer on the host
    (`resident` [S, L] False) counts the tokens and takes no pages: bringing it in takes
    them (`row_moves.bring`)."""
    n = jnp.broadcast_to(n_new[:, None, None], counts.high.shape).astype(jnp.int32)
    here = resident[..., None]
    free, tables, counts, _, ok = grow_high(free, tables, counts, jnp.where(here, n, 0),
                                            free.page_size, 1)
    counts = counts.replace(high=counts.high + jnp.where(here | ~ok, 0, n))
    return free, tables, counts, ok


@jax.jit
def clear(counts: TierCounts, mask: jax.Array) -> TierCounts:
    """The tiers of the slots where `mask` [S] is set, emptied (their pages: `release`)."""
    m = mask[:, None, None]
    return TierCounts(high=jnp.where(m, 0, counts.high), low=jnp.where(m, 0, counts.low))


@partial(jax.jit, static_argnames=("fates", "recent", "max_moves", "generation",
                                   "max_tokens"), donate_argnums=(0, 1, 2, 3, 4))
def retier(pool: KVPages, meta: TokenMeta, free: FreeList, tables: PageTables,
           counts: TierCounts, slots: jax.Array, n_prev: jax.Array, n: jax.Array,
           prompt_end: jax.Array, knobs: jax.Array, live: jax.Array, *, fates: Callable,
           recent: int,
           max_moves: int, generation: bool, max_tokens: int | None = None) -> tuple[
               KVPages, TokenMeta, FreeList, PageTables, TierCounts, jax.Array]:
    """The token policy's `fates` (with its `knobs`, float32) and compaction for the
    sequences in `slots` [B] (repeats only for rows that did not grow, n_prev == n) which
    grew from n_prev to n [B] tokens of prompts `prompt_end` [B] long: (pool, meta, free,
    tables, counts, ok). `generation`: they grew by decode steps, else by a prompt chunk; by
    at most `max_moves` tokens. When compaction cannot run (the pool is short of the low
    tier's new pages) nothing changes and ok is False. `max_tokens`: no tier of a row holds
    more (the placement then reads only the slots such a tier reaches). `live` [B, L]: the
    (row, layer)s placed; the others keep their tokens where they are (a layer on the host
    is placed in its own call while it is in the pool: `row_moves`)."""
    page = free.page_size
    sub = PageTables(pages=tables.pages[slots], num_pages=tables.num_pages[slots],
                     lengths=tables.lengths[slots], low_pages=tables.low_pages[slots])
    rows = TierCounts(high=counts.high[slots], low=counts.low[slots])
    placing = Placing(meta, sub.pages, rows, n_prev[:, None, None], n[:, None, None],
                      prompt_end[:, None, None], page, recent, max_tokens, max_moves,
                      generation)
    with jax.named_scope("place"):  # scopes name the phases in profiles (trace_ops.py)
        fate_hi, fate_lo = fates(placing, knobs)
        here = live[..., None, None]  # a layer on the host keeps every token where it is
        fate_hi, fate_lo = jnp.where(here, fate_hi, KEEP), jnp.where(here, fate_lo, KEEP)
    with jax.named_scope("compact"):
        free, sub, rows, moves, ok = compact(free, sub, rows, fate_hi, fate_lo, page, max_moves)
    with jax.named_scope("move"):
        pool, meta = move_pages(pool, moves, page), move_tokens(meta, moves)
    tables = tables.replace(pages=tables.pages.at[slots].set(sub.pages),
                            num_pages=tables.num_pages.at[slots].set(sub.num_pages),
                            low_pages=tables.low_pages.at[slots].set(sub.low_pages))
    counts = TierCounts(high=counts.high.at[slots].set(rows.high),
                        low=counts.low.at[slots].set(rows.low))
    return pool, meta, free, tables, counts, ok
