"""The engine's token-tier calls (LeanKV), each one jitted call over whole arrays.

Before a step `grow` gives each row's high tier the pages the step's full pages' tokens
join; the step writes them and adds every key's significance (`layer_kv.attend`); after it
`retier` runs Algorithm 1 over every (layer, KV head) of the step's rows at once (a prompt
chunk: `place`; decode steps: `place_generation`, the tokens that left the recent window
since the last placement and their victims; then `compact`) and moves the K/V and metadata
of the tokens that changed slots. `clear` empties the tiers of ended sequences.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jkv.kv.allocator import FreeList, PageTables
from jkv.kv.eviction import h2o_fates, streaming_fates
from jkv.kv.pages import KVPages
from jkv.kv.token_tiers import (
    TierCounts,
    TokenMeta,
    compact,
    grow_high,
    move_pages,
    move_tokens,
    place,
    place_generation,
)


@partial(jax.jit, donate_argnums=(0, 1, 2))
def grow(free: FreeList, tables: PageTables, counts: TierCounts,
         n_new: jax.Array) -> tuple[FreeList, PageTables, TierCounts, jax.Array]:
    """Room for n_new [S] more tokens at the end of every high tier of each slot: (free,
    tables, counts, ok); nothing changes when the pool is short."""
    n = jnp.broadcast_to(n_new[:, None, None], counts.high.shape).astype(jnp.int32)
    free, tables, counts, _, ok = grow_high(free, tables, counts, n, free.page_size, 1)
    return free, tables, counts, ok


@jax.jit
def clear(counts: TierCounts, mask: jax.Array) -> TierCounts:
    """The tiers of the slots where `mask` [S] is set, emptied (their pages: `release`)."""
    m = mask[:, None, None]
    return TierCounts(high=jnp.where(m, 0, counts.high), low=jnp.where(m, 0, counts.low))


@partial(jax.jit, static_argnames=("policy", "recent", "max_moves", "generation",
                                   "max_tokens"), donate_argnums=(0, 1, 2, 3, 4))
def retier(pool: KVPages, meta: TokenMeta, free: FreeList, tables: PageTables,
           counts: TierCounts, slots: jax.Array, n_prev: jax.Array, n: jax.Array,
           knobs: jax.Array, *, policy: str, recent: int, max_moves: int,
           generation: bool, max_tokens: int | None = None) -> tuple[
               KVPages, TokenMeta, FreeList, PageTables, TierCounts, jax.Array]:
    """`policy`'s placement and compaction for the sequences in `slots` [B] (repeats only for
    rows that did not grow, n_prev == n) which grew from n_prev to n [B] tokens: (pool,
    meta, free, tables, counts, ok). `knobs` float32 [4]: alpha_high, alpha_low (leankv),
    sink tokens (streaming), heavy-hitter ratio (h2o). `generation`: they grew by decode
    steps (Algorithm 1's generation phase), else by a prompt chunk; by at most `max_moves`
    tokens. When compaction cannot run (the pool is short of the low tier's new pages)
    nothing changes and ok is False. `max_tokens`: no tier of a row holds more (the
    placement then reads only the slots such a tier reaches)."""
    page = free.page_size
    sub = PageTables(pages=tables.pages[slots], num_pages=tables.num_pages[slots],
                     lengths=tables.lengths[slots], low_pages=tables.low_pages[slots])
    rows = TierCounts(high=counts.high[slots], low=counts.low[slots])
    n_prev, n = n_prev[:, None, None], n[:, None, None]
    alpha_high, alpha_low, sinks, ratio = knobs[0], knobs[1], knobs[2], knobs[3]
    where = dict(page=page, recent=recent, max_tokens=max_tokens)
    with jax.named_scope("place"):  # scopes name the phases in profiles (trace_ops.py)
        if policy == "leankv" and generation:
            fate_hi, fate_lo = place_generation(meta, sub.pages, rows, n_prev, n, **where,
                                                alpha_high=alpha_high, alpha_low=alpha_low,
                                                max_moves=max_moves, sinks=sinks)
        elif policy == "leankv":
            fate_hi, fate_lo = place(meta, sub.pages, rows, n_prev, n, **where,
                                     alpha_high=alpha_high, alpha_low=alpha_low, sinks=sinks)
        elif policy == "streaming":
            fate_hi, fate_lo = streaming_fates(meta, sub.pages, rows, n_prev, n, **where,
                                               sinks=sinks)
        else:
            fate_hi, fate_lo = h2o_fates(meta, sub.pages, rows, n_prev, n, **where,
                                         ratio=ratio)
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
