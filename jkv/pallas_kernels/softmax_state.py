"""Partial softmax states (unnormalised output, denominator, row max) merged by log-sum-exp:
how split-K partitions, tiers and a window's attention combine into one softmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def merge_softmax_states(o: jax.Array, denom: jax.Array, m: jax.Array,
                         axis: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Combine partial softmax states (unnormalised o [..., D], denominators and maxima [...])
    along a leading `axis` (the same for all three) by log-sum-exp; a part with no tokens has
    m = -inf and weight 0."""
    if axis < 0:
        raise ValueError(f"axis must count from the front, got {axis}")
    m_all = m.max(axis=axis, keepdims=True)
    m_all = jnp.where(jnp.isfinite(m_all), m_all, 0.0)
    w = jnp.exp(m - m_all)
    o = (o * w[..., None]).sum(axis=axis)
    denom = (denom * w).sum(axis=axis)
    return o, denom, jnp.squeeze(m_all, axis)


def normalize_softmax_state(o: jax.Array, denom: jax.Array) -> jax.Array:
    """o / denominator; rows that saw no token at all give 0."""
    return o / jnp.where(denom > 0, denom, 1.0)[..., None]
