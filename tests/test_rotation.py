"""The rotation of rotated KV formats: orthonormal and its own inverse at every head dim, so
attention is unchanged, and it is what makes few-bit per-token codes of vectors with outlier
channels fine (the reason it exists)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jkv.kv.quant import dequantize_values, quantize_values
from jkv.kv.rotation import hadamard, rotate


@pytest.mark.parametrize("d", [1, 64, 80, 96, 128])
def test_hadamard_is_orthonormal_symmetric_and_its_own_inverse(d):
    h = hadamard(d).astype(np.float64)
    np.testing.assert_allclose(h @ h.T, np.eye(d), atol=1e-6)
    np.testing.assert_array_equal(h, h.T)
    block = d & -d  # 80 = 5 x 16, 96 = 3 x 32: blocks never mix channels across them
    assert np.count_nonzero(h) == d * block
    assert np.allclose(np.abs(h[h != 0]), 1 / np.sqrt(block))


def test_rotate_keeps_dot_products_and_round_trips():
    rng = np.random.default_rng()
    q, k = (jnp.asarray(rng.normal(size=(5, 3, 64)), jnp.float32) for _ in range(2))
    np.testing.assert_allclose(np.einsum("thd,thd->th", rotate(q), rotate(k)),
                               np.einsum("thd,thd->th", q, k), rtol=1e-5, atol=1e-5)
    # two float32 sums of 64 terms each: a few ulps of the largest entry apart, by the order
    # the compiled matmul adds them in; a wrong rotation is off by O(1)
    tol = 2 * 64 * float(np.finfo(np.float32).eps) * float(np.abs(q).max())
    np.testing.assert_allclose(rotate(rotate(q)), q, atol=tol)
    assert rotate(q.astype(jnp.bfloat16)).dtype == jnp.bfloat16


@pytest.mark.parametrize("bits", [2, 4])
def test_rotation_makes_per_token_codes_of_outlier_channels_finer(bits):
    """Vectors whose few channels are far larger than the rest (SmolLM2's keys and values
    look so): rotated, quantized and rotated back, they are much closer to themselves."""
    rng = np.random.default_rng()
    x = rng.normal(size=(256, 64))
    x[:, rng.choice(64, 3, replace=False)] *= 20
    x = jnp.asarray(x, jnp.float32)

    def error(y):
        back = dequantize_values(*quantize_values(y, bits, 64), bits)
        return float(jnp.mean((back - y) ** 2))  # rotation keeps squared norms

    assert error(rotate(x)) < 0.5 * error(x)
