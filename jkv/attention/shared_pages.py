"""Attention over shared-layer pages in plain jnp (the `xla` backend's way through what
`pallas_kernels.shared_pages_attention` computes on a GPU).

The history's key coefficients are gathered by the page table and dequantized, multiplied by
the layer's key basis, rotated to their positions and scored; the value coefficients are
weighted by the softmax and only then multiplied by the value basis (plus the weights' sum
times the mean), so the values are never rebuilt per token. Float32 at the default matmul
precision. Returns the unnormalised softmax state or the normalised output, as the kernel.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from jkv.kv.quant import unpack
from jkv.kv.shared_pages import CoefficientPages, LayerBases
from jkv.pallas_kernels.page_blocks import MASK_VALUE
from jkv.pallas_kernels.softmax_state import normalize_softmax_state


def _coefficients(pool: CoefficientPages, page_table: jax.Array) -> jax.Array:
    """Every table column's coefficients, float32 [B, W * page, R]."""
    codes = pool.codes[page_table]  # [B, W, page, packed]
    codes = codes if pool.bits == 16 else unpack(codes, pool.bits)
    coef = (codes.astype(jnp.float32) * pool.scale[page_table][:, :, None].astype(jnp.float32)
            + pool.zero[page_table][:, :, None].astype(jnp.float32))
    b, w, page, r = coef.shape
    return coef.reshape(b, w * page, r)


@partial(jax.jit, static_argnames=("sm_scale", "return_softmax_state"))
def shared_pages_attention_xla(q: jax.Array, k: CoefficientPages, v: CoefficientPages,
                               bases: LayerBases, k_table: jax.Array, v_table: jax.Array,
                               lengths: jax.Array,
                               first_position: jax.Array, inv_freq: jax.Array, *,
                               sm_scale: float | None = None,
                               return_softmax_state: bool = False):
    """`shared_pages_attention` (same arguments and results) in XLA."""
    b, c, hq, d = q.shape
    hkv = bases.k_basis.shape[-1] // d
    g = hq // hkv
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    keys = (jnp.einsum("btr,brf->btf", _coefficients(k, k_table),
                       bases.k_basis.astype(jnp.float32)) + bases.k_mean[:, None])
    t = keys.shape[1]
    keys = keys.reshape(b, t, hkv, d)
    angle = (first_position[:, None] + jnp.arange(t))[..., None].astype(jnp.float32) * inv_freq
    cos, sin = (f(jnp.concatenate([angle, angle], -1))[:, :, None] for f in (jnp.cos, jnp.sin))
    keys = keys * cos + jnp.concatenate([-keys[..., d // 2:], keys[..., :d // 2]], -1) * sin
    qg = q.astype(jnp.float32).reshape(b, c, hkv, g, d) * sm_scale
    s = jnp.einsum("bchgd,bthd->bchgt", qg, keys)
    visible = (jnp.arange(t)[None] < lengths[:, None])[:, None, None, None]
    s = jnp.where(visible, s, MASK_VALUE)
    m = s.max(axis=-1)
    p = jnp.where(visible, jnp.exp(s - m[..., None]), 0.0)
    weighted = jnp.einsum("bchgt,btr->bchgr", p, _coefficients(v, v_table))
    v_basis = bases.v_basis.astype(jnp.float32).reshape(b, -1, hkv, d)
    denom = p.sum(axis=-1)
    o = (jnp.einsum("bchgr,brhd->bchgd", weighted, v_basis)
         + denom[..., None] * bases.v_mean.reshape(b, 1, hkv, 1, d))
    o, denom, m = o.reshape(b, c, hq, d), denom.reshape(b, c, hq), m.reshape(b, c, hq)
    if return_softmax_state:
        return o, denom, m
    return normalize_softmax_state(o, denom).astype(q.dtype)


__all__ = ["shared_pages_attention_xla"]
