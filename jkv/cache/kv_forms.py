"""Stored pages moved from one KV format to another: an entry recompressed to a smaller form
(AdaptCache), and a stored form restored into the running pool's format.

Pages are dequantized to float32 and quantized again the way the pool quantizes what it
writes (`KVPages.from_dense`), rotated into or out of the Hadamard basis where one format is
rotated and the other is not. The result holds the error of both formats: the tokens it
restores are approximate (never shared under exact hashes), like rebased ones.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from jkv.cache.rotation import rotate
from jkv.kv_format import KVFormat
from jkv.pallas_kernels.kv_pages import KVPages


def convert_pages(arrays: Mapping[str, np.ndarray | jax.Array], src: KVFormat,
                  dst: KVFormat, dtype) -> dict[str, np.ndarray]:
    """Named page arrays [..., page, D] of format `src` as those of `dst` (16-bit sides in
    `dtype`), on the host. The same format: the arrays as they are. ValueError when they are
    not pages of `src` (a tiered row's entry, say)."""
    if src == dst:
        return {name: np.asarray(x) for name, x in arrays.items()}
    try:
        pages = KVPages.from_arrays(src, {name: jax.numpy.asarray(x)
                                          for name, x in arrays.items()})
        lead = pages.k.shape[:-2]  # (blocks, layers, KV heads): checked as one pool
        flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[len(lead):]), pages)
        flat.check(pages.head_dim, "stored pages")
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"arrays are not pages of {src.name}: {e}") from e
    k, v = pages.dense()
    if src.rotated != dst.rotated:  # (the rotation is its own inverse)
        k, v = rotate(k), rotate(v)
    out = KVPages.from_dense(k, v, dst, dtype)
    return {name: np.asarray(x) for name, x in jax.device_get(out.arrays()).items()}


__all__ = ["convert_pages"]
