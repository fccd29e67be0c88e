"""Krul's layer-pair selection and MiniCache's merge against their definitions."""

from __future__ import annotations

import itertools
import math

import jax.numpy as jnp
import numpy as np
import pytest

from jkv.kv.layer_sharing import (
    deepest_pairs,
    edge_mass,
    expand,
    ir_layers,
    merge_pair,
    select_pairs,
)


def merge_reference(a: np.ndarray, b: np.ndarray, t: float) -> tuple[np.ndarray, np.ndarray]:
    """Test oracle: both layers' vectors [N, D] after a merge with nothing retained, one
    vector at a time in float64 (SLERP by its textbook formula)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    out_a, out_b = np.empty_like(a), np.empty_like(b)
    for n in range(len(a)):
        na, nb = np.linalg.norm(a[n]), np.linalg.norm(b[n])
        ua, ub = a[n] / na, b[n] / nb
        omega = math.acos(min(1.0, max(-1.0, float(ua @ ub))))
        if math.sin(omega) < 1e-6:
            d = (1 - t) * ua + t * ub
        else:
            d = (math.sin((1 - t) * omega) * ua + math.sin(t * omega) * ub) / math.sin(omega)
        d /= np.linalg.norm(d)
        out_a[n], out_b[n] = na * d, nb * d
    return out_a, out_b


def test_edge_mass_is_the_attention_on_the_first_and_last_tenth():
    t = 20  # edges: keys 0, 1 and 18, 19
    uniform = jnp.full((3, 5, t), 1.0 / t)
    assert float(edge_mass(uniform, t)) == pytest.approx(4 / t)
    sink = jnp.zeros((2, t)).at[:, 0].set(1.0)
    assert float(edge_mass(sink, t)) == pytest.approx(1.0)
    middle = jnp.zeros((2, t)).at[:, 10].set(1.0)
    assert float(edge_mass(middle, t)) == 0.0
    # keys past seq_len (padding) are never on the edge
    padded = jnp.zeros((1, t + 4)).at[0, t + 2].set(1.0)
    assert float(edge_mass(padded, t)) == 0.0


def brute_force(distance, ir, ratio):
    """Algorithm 1 lines 10-22 written out: every pair sorted, a greedy pass."""
    n = len(ir)
    pairs, used = [], set()
    order = sorted(itertools.combinations(range(n), 2), key=lambda p: (distance[p], p))
    for i, j in order:
        if not (ir[i] and ir[j]) or i in used or j in used:
            continue
        if len(used) >= n * ratio:
            break
        pairs.append((i, j))
        used |= {i, j}
    return pairs


@pytest.mark.parametrize("seed", range(5))
def test_pairs_are_the_closest_ir_layers_none_twice_until_the_ratio(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 16))
    d = rng.uniform(size=(n, n))
    d = d + d.T
    mass = rng.uniform(size=n)
    gamma, ratio = float(rng.uniform(0, 0.6)), float(rng.uniform(0, 1))
    ir = ir_layers(mass, gamma)
    assert (ir == (mass >= gamma)).all()
    pairs = select_pairs(d, ir, ratio)
    assert pairs == brute_force(d, ir, ratio)
    layers = [x for p in pairs for x in p]
    assert len(layers) == len(set(layers))  # no layer in two pairs
    assert all(ir[x] for x in layers)  # input-sensitive layers never merged
    assert all(i < j for i, j in pairs)
    # stops as soon as the ratio is reached (or the I-R layers run out)
    assert len(layers) - 2 < n * ratio or not pairs
    if len(layers) < n * ratio:
        free = [x for x in range(n) if ir[x] and x not in layers]
        assert len(free) < 2


def test_selection_rejects_bad_shapes_and_ratios():
    with pytest.raises(ValueError, match="distance"):
        select_pairs(np.zeros((3, 3)), np.ones(4, bool), 0.5)
    with pytest.raises(ValueError, match="ratio"):
        select_pairs(np.zeros((4, 4)), np.ones(4, bool), 1.5)


def test_deepest_pairs_are_adjacent_from_the_last_layer_down():
    assert deepest_pairs(30, 0.2) == [(24, 25), (26, 27), (28, 29)]
    assert deepest_pairs(5, 1.0) == [(1, 2), (3, 4)]
    assert deepest_pairs(8, 0.0) == []


def test_a_merge_expands_to_the_reference_merge():
    rng = np.random.default_rng()
    a = rng.normal(size=(3, 40, 16)).astype(np.float32)
    b = (0.6 * a + rng.normal(size=a.shape)).astype(np.float32)
    for t in (0.0, 0.3, 0.5, 1.0):
        m = merge_pair(jnp.asarray(a), jnp.asarray(b), t=t)
        ra, rb = merge_reference(a.reshape(-1, 16), b.reshape(-1, 16), t)
        np.testing.assert_allclose(np.asarray(expand(m, "a")).reshape(-1, 16), ra, atol=2e-5)
        np.testing.assert_allclose(np.asarray(expand(m, "b")).reshape(-1, 16), rb, atol=2e-5)
        # one direction shared, each layer's own norm kept
        np.testing.assert_allclose(np.linalg.norm(np.asarray(m.direction), axis=-1), 1.0,
                                   atol=1e-5)
        np.testing.assert_allclose(np.asarray(m.magnitude_b), np.linalg.norm(b, axis=-1),
                                   rtol=1e-5)
    same = merge_pair(jnp.asarray(a), jnp.asarray(a))  # identical layers: lossless
    np.testing.assert_allclose(np.asarray(expand(same, "b")), a, atol=1e-5)
    # opposite directions have no midpoint: they are the first retained
    flipped = a[:1].copy()
    flipped[0, 7] *= -1
    opposite = merge_pair(jnp.asarray(a[:1]), jnp.asarray(flipped), retain=1 / 40)
    assert np.flatnonzero(np.asarray(opposite.retained)).tolist() == [7]
    np.testing.assert_allclose(np.asarray(expand(opposite, "b")), flipped, atol=1e-5)


def test_the_farthest_apart_vectors_are_retained_whole():
    rng = np.random.default_rng()
    a = rng.normal(size=(200, 8)).astype(np.float32)
    b = rng.normal(size=(200, 8)).astype(np.float32)
    m = merge_pair(jnp.asarray(a), jnp.asarray(b), retain=0.1)
    kept = np.asarray(m.retained)
    assert kept.sum() == 20
    cos = np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    assert cos[kept].max() <= cos[~kept].min()  # the least aligned ones
    np.testing.assert_array_equal(np.asarray(expand(m, "a"))[kept], a[kept])
    np.testing.assert_array_equal(np.asarray(expand(m, "b"))[kept], b[kept])
    ra, rb = merge_reference(a[~kept], b[~kept], 0.5)
    np.testing.assert_allclose(np.asarray(expand(m, "a"))[~kept], ra, atol=2e-5)
    np.testing.assert_allclose(np.asarray(expand(m, "b"))[~kept], rb, atol=2e-5)
    with pytest.raises(ValueError, match="retain"):
        merge_pair(jnp.asarray(a), jnp.asarray(b), retain=2.0)
    with pytest.raises(ValueError, match="which"):
        expand(m, "c")
