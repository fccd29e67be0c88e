"""LeanKV's significance of each key, from the logits the attention kernels keep (plain jnp).

A kernel writes every key's logits in the same pass over its pages; the probabilities need
each row's final max and denominator, which exist only once the kernel (and, for decode,
the merge of its splits) is done. So the normalisation runs after the kernel, here, shared
by both kernels and by the `xla` backend (`key_significance`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jkv.pallas_kernels.page_blocks import MASK_VALUE


def key_significance(scores: jax.Array, m: jax.Array, denom: jax.Array, real: jax.Array,
                     g: int, count: jax.Array) -> jax.Array:
    """LeanKV's significance of each key from the logits of a step's queries: scores
    [B, Hkv, T * G, S] (rows t * G + g, MASK_VALUE where a query does not see a key)
    normalised by the rows' final max and denominator [B, Hkv, T * G], max over each
    query's G heads, summed over the real queries (`real` [B, T]) and divided by `count`,
    the queries that see each key (broadcastable to [B, Hkv, S]); 0 where none does."""
    b, hkv, _, n = scores.shape
    ok = jnp.repeat(real, g, axis=1)[:, None, :] & (m > 0.5 * MASK_VALUE) & (denom > 0)
    p = jnp.exp(scores - jnp.where(ok, m, 0.0)[..., None]) / jnp.where(ok, denom, 1.0)[..., None]
    p = jnp.where(ok[..., None], p, 0.0).reshape(b, hkv, -1, g, n).max(axis=3).sum(axis=2)
    return jnp.where(count > 0, p / jnp.maximum(count, 1), 0.0)


def paged_decode_significance(logits: list, m: jax.Array, denom: jax.Array, lengths: tuple,
                              w: int, per_query_head: bool) -> list[jax.Array]:
    """Each tier's significance from `paged_decode_attention`'s logits [B, Hkv, block_h,
    W * tier page] (a tier's columns as the table holds them) and the merged rows' max and
    denominator [B, Hkv, G], the tiers holding `lengths` [B, Hkv] tokens: in slot order,
    max over each KV head's query heads [B, Hkv, W * page], or with `per_query_head`
    unnormalised exp(logit - row max) [B, Hq, W * page]."""
    b, hkv, group_size = m.shape
    significance = []
    for i, s in enumerate(logits):
        s = s[:, :, :group_size]
        if i:  # low pages from the right: reversed columns are slot order
            s = s.reshape(b, hkv, group_size, w, -1)[:, :, :, ::-1].reshape(s.shape)
        held = jnp.arange(s.shape[-1]) < lengths[i][:, :, None, None]
        p = jnp.where(held, jnp.exp(s - m[..., None]), 0.0)
        if per_query_head:  # unnormalised per query head, like o
            significance.append(p.reshape(b, hkv * group_size, -1))
        else:
            significance.append((p / jnp.where(denom > 0, denom, 1.0)[..., None]).max(axis=2))
    return significance


def chunked_prefill_significance(state: list, lengths: tuple, q_lengths: jax.Array,
                                 significance_from: jax.Array | None, window_start: jax.Array,
                                 window_len: jax.Array, q_positions: jax.Array, *, w: int,
                                 window_tokens: int) -> tuple[jax.Array, ...]:
    """`chunked_prefill_attention`'s significance from the kernel's window logits, final
    (max, denominator) and tiers' logits (`state`, per real query head), the tiers holding
    `lengths` tokens: (the first tier's, the window's first `window_tokens` (the kernel's window
    may be padded), the low tier's if any). The queries that count are the real ones
    (`q_lengths`), from `significance_from` on when given."""
    sw, m, denom, *sp = state
    real = jnp.arange(q_positions.shape[1])[None, :] < q_lengths[:, None]  # [B, T]
    if significance_from is not None:
        real &= q_positions >= significance_from[:, None]
    window_len = jnp.minimum(window_len, sw.shape[-1])
    g = m.shape[2] // q_positions.shape[1]
    i = jnp.arange(sw.shape[-1])
    sees = ((i[None, None, :] < window_len[:, None, None])
            & (window_start[:, None, None] + i[None, None, :] <= q_positions[:, :, None])
            & real[:, :, None])  # [B, T, Tw]
    sees_rows = jnp.repeat(sees, g, axis=1)[:, None]  # [B, 1, T * G, Tw]
    significance = []
    for j, (n, scores) in enumerate(zip(lengths, sp, strict=True)):
        if j:  # the low tier's columns are from the right: reversed, they are slot order
            scores = scores.reshape(*scores.shape[:3], w, -1)[:, :, :, ::-1].reshape(
                scores.shape)
        held = jnp.arange(scores.shape[-1])[None, None, None, :] < n[:, :, None, None]
        significance.append(key_significance(
            jnp.where(held, scores, MASK_VALUE), m, denom, real, g,
            jnp.where(n > 0, real.sum(axis=1)[:, None], 0)[..., None]))
    window_sig = key_significance(jnp.where(sees_rows, sw, MASK_VALUE), m, denom, real, g,
                                  sees.sum(axis=1)[:, None, :])
    return significance[0], window_sig[..., :window_tokens], *significance[1:]
