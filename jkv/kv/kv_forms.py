"""Stored pages moved from one KV format to another: an entry recompressed to a smaller form
(AdaptCache), and a stored form restored into the running pool's format.

Pages are dequantized to float32 and quantized again the way the pool quantizes what it
writes (`KVPages.from_dense`), rotated into or out of the Hadamard basis where one format is
rotated and the other is not. The result holds the error of both formats: the tokens it
restores are approximate (never shared under exact hashes), like rebased ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jkv.kv.buckets import bucket
from jkv.kv.format import KVFormat
from jkv.kv.pages import KVPages
from jkv.kv.rotation import rotate


def convert_pages(arrays: Mapping[str, np.ndarray | jax.Array], src: KVFormat,
                  dst: KVFormat, dtype) -> dict[str, np.ndarray]:
    """Named page arrays [..., page, D] of format `src` as those of `dst` (16-bit sides in
    `dtype`), on the host. The same format: the arrays as they are. ValueError when they are
    not pages of `src` (a whole row's entry, say)."""
    if src == dst:
        return {name: np.asarray(x) for name, x in arrays.items()}
    try:
        pages = KVPages.from_arrays(src, {name: jnp.asarray(x)
                                          for name, x in arrays.items()})
        lead = pages.k.shape[:-2]  # (blocks, layers, KV heads): checked as one pool
        flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[len(lead):]), pages)
        flat.check(pages.head_dim, "stored pages")
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"arrays are not pages of {src.name}: {e}") from e
    n = pages.k.shape[0]  # blocks, padded to a power of two: few compiled shapes
    padded = KVPages.from_arrays(src, {
        name: np.concatenate([x, np.zeros((bucket(n) - n, *x.shape[1:]), x.dtype)])
        for name, x in ((name, np.asarray(x)) for name, x in arrays.items())})
    out = _convert(padded, dst, jnp.dtype(dtype))
    return {name: np.asarray(x)[:n] for name, x in jax.device_get(out.arrays()).items()}


@partial(jax.jit, static_argnames=("dst", "dtype"))
def _convert(pages: KVPages, dst: KVFormat, dtype) -> KVPages:
    k, v = pages.dense()
    if pages.kv_format.rotated != dst.rotated:  # (the rotation is its own inverse)
        k, v = rotate(k), rotate(v)
    return KVPages.from_dense(k, v, dst, dtype)


__all__ = ["convert_pages"]
