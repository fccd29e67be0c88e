"""The fixed rotation under which `rotated` KV formats store keys and values.

A normalised Hadamard matrix H is orthonormal and its own inverse (symmetric, H @ H = I), so
(q H) . (k H) = q . k, and attention over values v H, rotated back by H, is attention over v.
Rotating spreads each vector's few large channels over all of them: a group of channels that
shares one scale then quantizes every channel finely (QuaRot, SpinQuant; on SmolLM2 it is
what makes 2-bit values usable). Head dims that are not a power of two take a block-diagonal
H whose blocks are the largest power of two dividing them.
"""

from __future__ import annotations

from functools import cache

import jax
import jax.numpy as jnp
import numpy as np


@cache
def hadamard(head_dim: int) -> np.ndarray:
    """float32 [head_dim, head_dim]: the block-diagonal normalised Sylvester Hadamard matrix."""
    if head_dim <= 0:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    block = head_dim & -head_dim  # the largest power of two dividing head_dim
    h = np.ones((1, 1))
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    out = np.kron(np.eye(head_dim // block), h / np.sqrt(block)).astype(np.float32)
    out.flags.writeable = False
    return out


def rotate(x: jax.Array) -> jax.Array:
    """x [..., D] in the rotated basis, or back out of it (H is its own inverse); computed
    in float32 at full precision, returned in x's dtype."""
    h = jnp.asarray(hadamard(x.shape[-1]))
    y = jnp.matmul(x.astype(jnp.float32), h, precision=jax.lax.Precision.HIGHEST)  # no TF32
    return y.astype(x.dtype)
