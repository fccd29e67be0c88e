"""Krul's cross-layer KV sharing: which layers of a conversation share KV, and what they share.

Selection (Krul, Algorithm 1). A layer whose attention puts less than `gamma` of its mass,
averaged over heads and queries, on the first and last 10% of the tokens is input-sensitive
(not "I-R") and is never merged. Among the I-R layers, pairs are taken by ascending distance
between their attention patterns, no layer in two pairs, until `ratio` of all layers are
merged. What is computed from attention (the edge mass per layer, the distance per pair)
comes in as plain arrays: the selection itself is a pure function.

Merge (MiniCache). Per (token, KV head) both layers' vectors are split into a magnitude and a
direction; the pair keeps one direction, the SLERP of the two at `t`, and each layer its own
magnitude, so a layer's vector comes back as its magnitude times the shared direction. The
(token, head)s whose directions are farthest apart, a `retain` fraction of them, keep both
layers' own vectors. Keys (as the pool holds them: rotated to their positions, the same
rotation in both layers) and values are merged separately.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

EDGE_FRACTION = 0.1  # Algorithm 1: the first and last 10% of the tokens


def edge_mass(probs: jax.Array, seq_len: int) -> jax.Array:
    """Attention mass on the first and last `EDGE_FRACTION` of `seq_len` keys, averaged over
    everything but the last axis: probs [..., queries, keys] (rows of softmax weights, keys
    [0, seq_len)). Algorithm 1 lines 4-6."""
    edge = max(1, math.ceil(EDGE_FRACTION * seq_len))
    keys = jnp.arange(probs.shape[-1])
    on_edge = (keys < edge) | ((keys >= seq_len - edge) & (keys < seq_len))
    return jnp.mean(jnp.sum(jnp.where(on_edge, probs, 0.0), axis=-1))


def ir_layers(mass: Sequence[float], gamma: float) -> np.ndarray:
    """Which layers follow the initial-recent pattern (may be merged): mass at least
    `gamma` (Algorithm 1 lines 1-8: below it a layer is input-sensitive)."""
    return np.asarray(mass, np.float64) >= gamma


def select_pairs(distance: np.ndarray, ir: np.ndarray, ratio: float) -> list[tuple[int, int]]:
    """Layer pairs (i, j), i < j, that share KV: I-R pairs by ascending `distance`
    [L, L] (symmetric; ties by the pair's layers), no layer in two pairs, until at least
    `ratio` of all L layers are in a pair (Algorithm 1 lines 10-22)."""
    distance = np.asarray(distance, np.float64)
    num_layers = len(ir)
    if distance.shape != (num_layers, num_layers):
        raise ValueError(f"distance must be [{num_layers}, {num_layers}], "
                         f"got {list(distance.shape)}")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    candidates = sorted((float(distance[i, j]), i, j) for i in range(num_layers)
                        for j in range(i + 1, num_layers) if ir[i] and ir[j])
    pairs: list[tuple[int, int]] = []
    shared: set[int] = set()
    for _, i, j in candidates:
        if len(shared) >= num_layers * ratio:
            break
        if i in shared or j in shared:
            continue
        shared |= {i, j}
        pairs.append((i, j))
    return pairs


def deepest_pairs(num_layers: int, ratio: float) -> list[tuple[int, int]]:
    """The fixed strategy Krul compares against (MiniCache's): adjacent pairs from the last
    layer down, until at least `ratio` of the layers are in a pair."""
    pairs: list[tuple[int, int]] = []
    j = num_layers - 1
    while j >= 1 and 2 * len(pairs) < num_layers * ratio:
        pairs.append((j - 1, j))
        j -= 2
    return sorted(pairs)


class Merged(NamedTuple):
    """Two layers' vectors [..., T, D] as one: `direction` (unit vectors; where `retained`,
    layer a's own vector), each layer's `magnitude` [..., T], and layer b's own vectors
    where `retained` [..., T] (zeros elsewhere)."""

    direction: jax.Array
    magnitude_a: jax.Array
    magnitude_b: jax.Array
    retained: jax.Array
    own_b: jax.Array


def _unit(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    norm = jnp.linalg.norm(x, axis=-1)
    return x / jnp.maximum(norm, 1e-12)[..., None], norm


def slerp(a: jax.Array, b: jax.Array, t: float) -> jax.Array:
    """Spherical interpolation between unit vectors a and b [..., D] at `t` (0: a, 1: b);
    linear where they are (anti)parallel to within float precision (opposite vectors have
    no midpoint: zero at t = 0.5, which is why the farthest apart are retained)."""
    cos = jnp.clip(jnp.sum(a * b, axis=-1, keepdims=True), -1.0, 1.0)
    omega = jnp.arccos(cos)
    sin = jnp.sin(omega)
    small = sin < 1e-6
    safe = jnp.where(small, 1.0, sin)
    wa = jnp.where(small, 1.0 - t, jnp.sin((1.0 - t) * omega) / safe)
    wb = jnp.where(small, t, jnp.sin(t * omega) / safe)
    out = wa * a + wb * b
    return _unit(out)[0]


def merge_pair(a: jax.Array, b: jax.Array, *, t: float = 0.5,
               retain: float = 0.0) -> Merged:
    """Merge layer a's and layer b's vectors [..., T, D] (float32): see `Merged`. `retain`:
    the fraction of vectors (over all leading axes and T) whose directions are farthest
    apart, kept as they are for both layers."""
    if not 0.0 <= retain <= 1.0:
        raise ValueError(f"retain must be in [0, 1], got {retain}")
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    ua, na = _unit(a)
    ub, nb = _unit(b)
    cos = jnp.sum(ua * ub, axis=-1)
    k = int(round(retain * cos.size))
    if k:
        threshold = jnp.sort(cos.reshape(-1))[k - 1]
        retained = cos <= threshold
    else:
        retained = jnp.zeros(cos.shape, bool)
    direction = jnp.where(retained[..., None], a, slerp(ua, ub, t))
    own_b = jnp.where(retained[..., None], b, 0.0)
    return Merged(direction, na, nb, retained, own_b)


def expand(m: Merged, which: str) -> jax.Array:
    """Layer `which` ("a" or "b")'s vectors [..., T, D] back from a merge: its magnitude
    times the shared direction, its own vector where retained."""
    if which == "a":
        return jnp.where(m.retained[..., None], m.direction,
                         m.magnitude_a[..., None] * m.direction)
    if which == "b":
        return jnp.where(m.retained[..., None], m.own_b, m.magnitude_b[..., None] * m.direction)
    raise ValueError(f"which must be 'a' or 'b', got {which!r}")


__all__ = ["EDGE_FRACTION", "Merged", "deepest_pairs", "edge_mass", "expand", "ir_layers",
           "merge_pair", "select_pairs", "slerp"]
