"""The pruning baselines users know, as fates on LeanKV's token-tier machinery (one tier, no
low precision): what `tier_step.retier` runs instead of Algorithm 1 under kv_policy
"streaming" or "h2o".

StreamingLLM keeps the first `sinks` tokens (attention sinks) and the recent window; every
other token is pruned as it leaves the window. H2O keeps the recent window and the heavy
hitters: the tokens with the most attention received so far (summed, as H2O accumulates
it), `ratio` of the sequence's tokens for every head alike.

Both return `compact`'s fates (per high slot, and the unused low tier's) for prompt chunks
and for decode steps alike: the tokens that left the window since the last placement.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jkv.kv.token_tiers import KEEP, PRUNE, TierCounts, TokenMeta, read_rows


def _heavy_budget(n: jax.Array, ratio: jax.Array) -> jax.Array:
    return jnp.ceil(ratio * n.astype(jnp.float32)).astype(jnp.int32)


def streaming_fates(meta: TokenMeta, pages: jax.Array, counts: TierCounts, n_prev: jax.Array,
                    n: jax.Array, *, page: int, recent: int, sinks: jax.Array,
                    max_tokens: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Every token leaving the window is pruned unless it is a sink."""
    rows = read_rows(meta, pages, counts, n_prev, n, page=page, recent=recent,
                     max_tokens=max_tokens)
    fate = jnp.where(rows["cand"] & (rows["hi_pos"] >= sinks), PRUNE, KEEP)
    return fate, jnp.full(rows["lo_pos"].shape, KEEP)


def h2o_fates(meta: TokenMeta, pages: jax.Array, counts: TierCounts, n_prev: jax.Array,
              n: jax.Array, *, page: int, recent: int, ratio: jax.Array,
              max_tokens: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Of the tokens outside the window, the `ratio * n` with the most
    attention received stay (ties: the earlier token), the others are pruned."""
    rows = read_rows(meta, pages, counts, n_prev, n, page=page, recent=recent,
                     max_tokens=max_tokens)
    old, score, pos = rows["old"], rows["hi_score"], rows["hi_pos"]
    # a token's rank among its row's old tokens: how many beat it
    key = jnp.where(old, score, -jnp.inf)
    order = jnp.lexsort((pos, -key), axis=-1)
    rank = jnp.argsort(order, axis=-1)
    budget = _heavy_budget(jnp.broadcast_to(n, counts.high.shape), ratio)[..., None]
    fate = jnp.where(old & (rank >= budget), PRUNE, KEEP)
    return fate, jnp.full(rows["lo_pos"].shape, KEEP)
