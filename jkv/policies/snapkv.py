"""SnapKV (Li et al., 2024): each head keeps the prompt tokens its last queries attend to.

The prompt's last `kv_recent_window` queries are the observation window: when the prompt's
last chunk has run, each (layer, KV head) sums the attention every older token got from
those queries (max over the KV head's query heads, as jkv's significance is), pools the sums
over neighbouring tokens (a mean over `POOL` tokens, so that a kept token brings its
neighbours' context along), and keeps the `kv_heavy_ratio` share of the prompt with the
highest pooled votes beside the window itself; the other prompt tokens are pruned. Tokens
generated later are all kept, as SnapKV compresses the prompt only.

Only the chunk that ends the prompt decides: before it the votes are not in; after it (a
preempted request resuming with its output so far) the prompt was decided already. A prompt
that extends a kept conversation's row is voted on again at its end, over the tokens that row
still holds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jkv.kv.tier_step import Placing
from jkv.kv.token_tiers import KEEP
from jkv.policies.registry import KVPolicy, keep_top, needs_single_tokens, share_of

POOL = 7  # tokens a vote is averaged over (SnapKV's pooling kernel)


def pooled_votes(score: jax.Array, pos: jax.Array, among: jax.Array,
                 width: int = POOL) -> jax.Array:
    """Each slot's vote [..., C] averaged with its neighbours in position order: over the
    `width` tokens of `among` centred on it (fewer at the ends); slots not in `among` 0."""
    order = jnp.argsort(jnp.where(among, pos, jnp.iinfo(jnp.int32).max), axis=-1)
    held = jnp.take_along_axis(among, order, -1)
    votes = jnp.where(held, jnp.take_along_axis(score, order, -1), 0.0)
    half = width // 2

    def window_sum(x: jax.Array) -> jax.Array:
        c = jnp.cumsum(jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(half + 1, half)]), axis=-1)
        return c[..., width:] - c[..., :-width]

    mean = window_sum(votes) / jnp.maximum(window_sum(held.astype(jnp.float32)), 1.0)
    back = jnp.argsort(order, axis=-1)
    return jnp.where(among, jnp.take_along_axis(mean, back, -1), 0.0)


def snapkv_fates(x: Placing, knobs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """In the chunk that ends the prompt, of the tokens older than the window, the
    `ratio * n` with the highest pooled votes stay, the others are pruned; otherwise every
    token stays. knobs: the kept share of the prompt."""
    rows = x.rows()
    keep_all = jnp.full(rows["hi_pos"].shape, KEEP)
    if x.generation:
        return keep_all, jnp.full(rows["lo_pos"].shape, KEEP)
    n = jnp.broadcast_to(x.n, x.counts.high.shape)
    votes = pooled_votes(rows["hi_score"], rows["hi_pos"], rows["old"])
    fate = keep_top(votes, rows["hi_pos"], rows["old"], share_of(n, knobs[0])[..., None])
    ended = jnp.broadcast_to((x.n_prev < x.prompt_end) & (x.n >= x.prompt_end), n.shape)
    return jnp.where(ended[..., None], fate, keep_all), jnp.full(rows["lo_pos"].shape, KEEP)


POLICY = KVPolicy(
    name="snapkv",
    summary="at the prompt's end each head keeps the prompt tokens its last "
            "`kv_recent_window` queries attend to most, pooled over neighbours, a share of "
            "the prompt, and the window itself; generated tokens all kept (SnapKV)",
    fates=snapkv_fates, knobs=("kv_heavy_ratio",), decides_at_prompt_end=True,
    check=needs_single_tokens)
