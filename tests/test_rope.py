"""RoPE: rotations compose (what moving stored keys relies on), and scores depend only on
relative position."""

import jax
import jax.numpy as jnp
import numpy as np

from jkv.config import RopeScaling
from jkv.models.rope import apply_rope, inv_frequencies


def _x(shape):
    return jnp.asarray(np.random.default_rng().normal(size=shape), jnp.float32)


def test_rotating_by_a_shift_moves_a_key_to_its_new_position():
    rng = np.random.default_rng()
    x = _x((2, 7, 3, 64))
    pos = jnp.asarray(rng.integers(0, 8000, (2, 7)), jnp.int32)
    shift = jnp.asarray(rng.integers(-4000, 0, (2, 7)), jnp.int32)
    inv = jnp.asarray(inv_frequencies(64, 1e5, RopeScaling()))
    y = apply_rope(x, pos, inv)
    assert not np.allclose(y, x)
    # float32 angles of positions up to 8000 carry ~5e-4 rad of rounding either way
    np.testing.assert_allclose(apply_rope(y, shift, inv), apply_rope(x, pos + shift, inv),
                               atol=2e-3)
    assert np.abs(apply_rope(y, shift + 1, inv) - apply_rope(x, pos + shift, inv)).max() > 0.1


def test_scores_depend_on_relative_position_only():
    q, k = _x((1, 1, 1, 32)), _x((1, 1, 1, 32))
    inv = jnp.asarray(inv_frequencies(32, 1e4, RopeScaling(original_max_position_embeddings=64)))

    def score(pq, pk):
        rq = apply_rope(q, jnp.array([[pq]]), inv)
        rk = apply_rope(k, jnp.array([[pk]]), inv)
        return float(jnp.sum(rq * rk))

    assert abs(score(10, 3) - score(110, 103)) < 1e-3
    assert abs(score(10, 3) - score(10, 4)) > 1e-4


def test_llama3_scaling_slows_only_low_frequencies():
    plain = inv_frequencies(128, 5e5)
    scaled = inv_frequencies(128, 5e5, RopeScaling())
    assert np.allclose(scaled[:8], plain[:8])  # high frequencies untouched
    np.testing.assert_allclose(scaled[-4:], plain[-4:] / 8.0, rtol=1e-6)
    assert jax.numpy.all(scaled <= plain + 1e-12)
