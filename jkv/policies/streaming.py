"""StreamingLLM (Xiao et al.): the first `kv_sink_tokens` (attention sinks) and the recent
window are kept; every other token is pruned as it leaves the window. One tier, no low
precision, no significance read."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jkv.kv.tier_step import Placing
from jkv.kv.token_tiers import KEEP, PRUNE
from jkv.policies.registry import KVPolicy, needs_single_tokens


def streaming_fates(x: Placing, knobs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Every token leaving the window is pruned unless it is a sink; knobs: sink tokens."""
    rows = x.rows()
    fate = jnp.where(rows["cand"] & (rows["hi_pos"] >= knobs[0]), PRUNE, KEEP)
    return fate, jnp.full(rows["lo_pos"].shape, KEEP)


def newest_first(pos: np.ndarray, score: np.ndarray, n: int) -> np.ndarray:
    """A smaller stored form's choice (`streaming@<keep>`): the newest tokens."""
    return pos.astype(np.float64)


POLICY = KVPolicy(
    name="streaming",
    summary="attention sinks and the recent window, the rest pruned (StreamingLLM)",
    fates=streaming_fates, knobs=("kv_sink_tokens",), check=needs_single_tokens,
    form_merit=newest_first)
