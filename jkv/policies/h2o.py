"""H2O (Zhang et al.): the recent window and the heavy hitters, the tokens with the most
attention received so far (summed, as H2O accumulates it), `kv_heavy_ratio` of the
sequence's tokens for every head alike. Every placement ranks all old tokens again."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jkv.kv.tier_step import Placing
from jkv.kv.token_tiers import KEEP, PRUNE
from jkv.policies.registry import KVPolicy, needs_single_tokens


def keep_top(score: jax.Array, pos: jax.Array, among: jax.Array,
             budget: jax.Array) -> jax.Array:
    """Fates for one tier's slots [..., C]: of `among`, the `budget` [..., 1] with the highest
    `score` are kept (ties: the earlier position), the others pruned; the rest kept."""
    key = jnp.where(among, score, -jnp.inf)
    order = jnp.lexsort((pos, -key), axis=-1)
    rank = jnp.argsort(order, axis=-1)  # how many of the row beat each token
    return jnp.where(among & (rank >= budget), PRUNE, KEEP)


def share_of(n: jax.Array, ratio: jax.Array) -> jax.Array:
    """ceil(ratio * n) as int32: the tokens a share of n keeps."""
    return jnp.ceil(ratio * n.astype(jnp.float32)).astype(jnp.int32)


def h2o_fates(x: Placing, knobs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Of the tokens outside the window, the `ratio * n` with the most attention received
    stay, the others are pruned; knobs: the heavy-hitter ratio."""
    rows = x.rows()
    budget = share_of(jnp.broadcast_to(x.n, x.counts.high.shape), knobs[0])[..., None]
    fate = keep_top(rows["hi_score"], rows["hi_pos"], rows["old"], budget)
    return fate, jnp.full(rows["lo_pos"].shape, KEEP)


POLICY = KVPolicy(
    name="h2o",
    summary="the recent window and the most attended tokens, a share of the sequence per "
            "head (H2O)",
    fates=h2o_fates, knobs=("kv_heavy_ratio",), check=needs_single_tokens)
