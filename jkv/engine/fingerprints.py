"""Fingerprints of the model's state at block starts: what a verified restore compares.

A stored entry ends at a block boundary, and the token just past it (position p, a block
start) was computed while its KV was made. That token's final hidden state depends on every
stored page through attention (each layer's), so the same token computed at p again over the
restored KV gives the same state within the KV format's noise, and pages of other tokens or
layers, or a bad conversion, give another. (The last layer's key of that token would miss the
last layer's attention and need each layer to hand it out; the final state is at hand where
the runner samples.) Each compiled call returns per row the final-normed
hidden state at the first and the last block start among the row's tokens (`marks`, traced
inside the runner's calls: a gather and a small matmul), sketched down to `SKETCH_DIMS`
numbers by a fixed Gaussian projection: a few hundred bytes whatever the model's width, so a
step's outputs stay small, and a relative distance is kept to within about
1 / sqrt(SKETCH_DIMS) of itself.
The scheduler keeps each request's latest ones (`jkv.sched.restore_checks`): a save stores
the one just past its blocks with the entry, and a restore's first step computes the one it
is compared with (`jkv.store.verify`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

SKETCH_DIMS = 64
_SEED = 0x6A6B76  # the projection is the same in every process: stored fingerprints compare


def sketch_matrix(hidden_size: int) -> np.ndarray:
    """The fixed projection of a hidden state, [hidden_size, SKETCH_DIMS] float32."""
    rng = np.random.default_rng(_SEED)
    m = rng.standard_normal((hidden_size, SKETCH_DIMS)) / np.sqrt(SKETCH_DIMS)
    return m.astype(np.float32)


def marks(hidden: jax.Array, positions: jax.Array, valid: jax.Array, sketch: jax.Array,
          page_size: int) -> tuple[jax.Array, jax.Array]:
    """Each row's first and last block start among its valid tokens: (positions [B, 2] int32,
    -1 where the row has none; the sketched final-normed `hidden` [B, T, D] there [B, 2,
    SKETCH_DIMS] float32). Traced inside the runner's compiled calls."""
    starts = valid & (positions % page_size == 0)
    t = starts.shape[1]
    idx = jnp.stack([jnp.argmax(starts, axis=1), t - 1 - jnp.argmax(starts[:, ::-1], axis=1)],
                    axis=1)
    found = jnp.take_along_axis(starts, idx, axis=1)
    at = jnp.where(found, jnp.take_along_axis(positions, idx, axis=1), -1).astype(jnp.int32)
    h = jnp.take_along_axis(hidden, idx[:, :, None], axis=1).astype(jnp.float32)
    return at, h @ sketch
