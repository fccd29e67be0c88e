"""The pages beside the pool: the one each sequence is filling, and what a page costs.

A page holds `page_size` tokens of one KV head of one layer, in the pool's `KVFormat`: model
dtype, or packed integer codes with scales and zero points beside them (the pool is a
`KVPages`, the one place that layout is written). The page a sequence is filling stays in
full precision in `FillingPages` until it is full and is then quantized as a unit
(KIVI/LeanKV's recent window). Which page ids are free and who holds them: `allocator`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jkv.kv.format import KVFormat


@struct.dataclass
class FillingPages:
    """The page each (sequence slot, layer, KV head) is filling, in model dtype: tokens
    [page_size * (length // page_size), length) of the sequence."""

    k: jax.Array  # [S, L, Hkv, page, D]
    v: jax.Array  # [S, L, Hkv, page, D]
    score: jax.Array | None = None  # float32 [S, L, Hkv, page]: token tiers' attention sums


def page_bytes(kv_format: KVFormat, page_size: int, head_dim: int, dtype) -> int:
    """Bytes one page takes in the pool, scales and zero points included."""
    per_token = kv_format.bytes_per_token(head_dim, jnp.dtype(dtype).itemsize)
    return int(page_size * per_token) + kv_format.key_page_overhead_bytes(head_dim)


def init_filling(max_seqs: int, num_layers: int, num_kv_heads: int, page_size: int,
                 head_dim: int, dtype=jnp.bfloat16, scores: bool = False) -> FillingPages:
    """Empty filling pages for `max_seqs` sequence slots (with each token's significance
    when `scores`: token tiers read it)."""
    shape = (max_seqs, num_layers, num_kv_heads, page_size, head_dim)
    score = jnp.zeros(shape[:-1], jnp.float32) if scores else None
    return FillingPages(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), score=score)
