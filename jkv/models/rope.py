"""Rotary position embedding in the rotate-half layout of Hugging Face checkpoints.

Rotations compose: `apply_rope` at position d of a key already rotated to p gives the key at
p + d. That is how stored keys move when a conversation's oldest turns are dropped
(`jkv.kv.rebase`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jkv.config import RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """Per-pair inverse frequencies [head_dim // 2], with optional Llama-3 scaling."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv.astype(np.float32)
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin [B, T, D] of positions [B, T]: what `apply_rope` rotates by."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [..., D]
    return jnp.cos(angles), jnp.sin(angles)


def _rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rotate(x: jax.Array, tables: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate x [B, T, H, D] by `rope_tables` [B, T, D] (computed once for every layer and
    head: fused into a rotation, XLA would evaluate the cos and sin once per head)."""
    cos, sin = tables[0][:, :, None, :], tables[1][:, :, None, :]
    xf = x.astype(jnp.float32)
    return (xf * cos + _rotate_half(xf) * sin).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate x [B, T, H, D] to positions [B, T]."""
    return rotate(x, rope_tables(positions, inv_freq))
