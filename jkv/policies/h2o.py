"""H2O (Zhang et al.): the recent window and the heavy hitters, the tokens with the most
attention received so far (summed, as H2O accumulates it), `kv_heavy_ratio` of the
sequence's tokens for every head alike. Every placement ranks all old tokens again."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jkv.kv.tier_step import Placing
from jkv.kv.token_tiers import KEEP
from jkv.policies.registry import KVPolicy, keep_top, needs_single_tokens, share_of


def h2o_fates(x: Placing, knobs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Of the tokens outside the window, the `ratio * n` with the most attention received
    stay, the others are pruned; knobs: the heavy-hitter ratio."""
    rows = x.rows()
    budget = share_of(jnp.broadcast_to(x.n, x.counts.high.shape), knobs[0])[..., None]
    fate = keep_top(rows["hi_score"], rows["hi_pos"], rows["old"], budget)
    return fate, jnp.full(rows["lo_pos"].shape, KEEP)


def most_attended(pos: np.ndarray, score: np.ndarray, n: int) -> np.ndarray:
    """A smaller stored form's choice (`h2o@<keep>`): the most mean attention received,
    from the n - pos queries at or after each token (the scores a row stores: LeanKV's
    significance, H2O's heavy hitters)."""
    return score.astype(np.float64) / np.maximum(n - pos, 1)


POLICY = KVPolicy(
    name="h2o",
    summary="the recent window and the most attended tokens, a share of the sequence per "
            "head (H2O)",
    fates=h2o_fates, knobs=("kv_heavy_ratio",), check=needs_single_tokens,
    form_merit=most_attended)
