"""The steps both paged kernels take inside their loop over a tier's pages (Pallas).

`paged_decode_attention` and `chunked_prefill_attention` walk blocks of pages the same way:
load a block's codes by channel part, dequantize them (in float32, or in float16 by their
bit pattern), dot them with the matching slice of q and fold the block into an online
softmax. Kept in one place so the two kernels share one dequantization and one softmax.

Layout (see `kv_quant`): b-bit codes are packed k = 8 // b per byte along channels, "part" i
of a byte holding the channel block [i * D/k, (i + 1) * D/k). `attend_block` dots each part with
the matching slice of q, so no interleaving or concatenation happens on the GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jkv.kv.pages import KVPages
from jkv.kv.quant import codes_per_byte

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def dot_t(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] @ b[N, K]^T in float32 (IEEE for float32 operands, not TF32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b.T, precision=precision, preferred_element_type=jnp.float32)


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def _expand_pages(x: jax.Array, page: int) -> jax.Array:
    """Per-page rows [ppb, C] -> per-token rows [ppb * page, C]."""
    ppb, c = x.shape
    return jnp.broadcast_to(x[:, None, :], (ppb, page, c)).reshape(ppb * page, c)


def _load_part(ref, pages, bits: int, part: int, width: int, cache: dict, flat: bool = True):
    """Channels [part * width, (part + 1) * width) of pages [ppb] as unpacked (still integer or
    model-dtype) values [ppb * page, width] (`flat`) or [ppb, page, width]. Packed bytes are
    loaded once per byte range."""
    per_byte = codes_per_byte(bits) if bits < 16 else 1
    block = ref.shape[-1]  # channels per packed part
    i, offset = divmod(part * width, block)
    key = (offset, width)
    if key not in cache:
        codes = ref[pages, :, pl.ds(offset, width)]
        cache[key] = codes.reshape(codes.shape[0] * codes.shape[1], width) if flat else codes
    codes = cache[key]
    if per_byte == 1:
        return codes
    return (codes >> (bits * i)) & ((1 << bits) - 1)


def online_update(carry: tuple, logits: jax.Array, visible: jax.Array,
                  values: Callable[[int], jax.Array]) -> tuple:
    """Fold one block of keys into the online-softmax state (o parts, row max, denominator).

    logits [rows, block_k] f32; visible [rows or 1, block_k]; values(i) gives the block's
    values for output part i, in the dtype of their dot (p is cast to it). Masked keys get
    probability exactly 0, so a fully masked block (or a row that sees nothing yet) leaves
    the state unchanged.
    """
    o_parts, m_prev, l_prev = carry
    logits = jnp.where(visible, logits, MASK_VALUE)
    m_next = jnp.maximum(m_prev, logits.max(axis=-1))
    correction = jnp.exp(m_prev - m_next)
    p = jnp.where(visible, jnp.exp(logits - m_next[:, None]), 0.0)
    l_next = correction * l_prev + p.sum(axis=-1)
    cast: dict = {}  # p in each values dtype, cast once

    def weighted(v):
        if v.dtype not in cast:
            cast[v.dtype] = p.astype(v.dtype)
        return _dot(cast[v.dtype], v)

    new_parts = tuple(correction[:, None] * o_i + weighted(values(i))
                      for i, o_i in enumerate(o_parts))
    return new_parts, m_next, l_next


def _dequantize(codes, scale_ref, zero_ref, pages, part: int, width: int, *, page: int,
                per_token: bool, group: int):
    """Codes [ppb * page, width] of channel part `part` as float32 values: scales per (page,
    channel) [P, D], or per (token, group of channels) [P, page, D // group]."""
    block_k = codes.shape[0]
    if per_token:
        n = max(width // group, 1)  # groups inside one channel part
        first = (part * width) // group
        scale = scale_ref[pages, :, pl.ds(first, n)].reshape(block_k, n).astype(jnp.float32)
        zero = zero_ref[pages, :, pl.ds(first, n)].reshape(block_k, n).astype(jnp.float32)
        each = min(group, width)
        scale = jnp.broadcast_to(scale[:, :, None], (block_k, n, each)).reshape(block_k, width)
        zero = jnp.broadcast_to(zero[:, :, None], (block_k, n, each)).reshape(block_k, width)
    else:
        scale = _expand_pages(scale_ref[pages, pl.ds(part * width, width)], page)
        zero = _expand_pages(zero_ref[pages, pl.ds(part * width, width)], page)
        scale, zero = scale.astype(jnp.float32), zero.astype(jnp.float32)
    return codes.astype(jnp.float32) * scale + zero


def _codes_f16(codes: jax.Array) -> jax.Array:
    """Integer codes (0..255) as exact float16 without an int-to-float conversion: the bit
    pattern 0x6400 | c is the float16 1024 + c (the float32 path converts every element to
    float32 and back to 16 bits; on a GPU this one decodes at least as fast)."""
    bits = codes.astype(jnp.uint16) | jnp.uint16(0x6400)
    return lax.bitcast_convert_type(bits, jnp.float16) - jnp.float16(1024)


def _dequantize_f16(codes, scale_ref, zero_ref, pages, part: int, width: int, *,
                    per_token: bool, group: int):
    """Codes [ppb, page, width] of channel part `part` as float16 values [ppb * page, width],
    scaled in float16 (the stored dtype of scales and zero points, so nothing else is
    converted). A per-token part lies inside one group (`checked_tiers(group_parts=True)`),
    so its scale is one column broadcast along channels; per-page scales broadcast along
    the page's tokens before the tokens are flattened."""
    ppb, page = codes.shape[:2]
    if per_token:
        g = (part * width) // group
        scale, zero = scale_ref[pages, :, pl.ds(g, 1)], zero_ref[pages, :, pl.ds(g, 1)]
    else:
        scale = scale_ref[pages, pl.ds(part * width, width)][:, None, :]
        zero = zero_ref[pages, pl.ds(part * width, width)][:, None, :]
    values = _codes_f16(codes) * scale + zero
    return values.reshape(ppb * page, width)


def attend_block(carry: tuple, tier: KVPages, pages: jax.Array, visible: jax.Array, *,
                 q_parts: dict, compute, half: bool = False) -> tuple:
    """One online-softmax step over the pages `pages` [ppb] of one tier (a KVPages of the
    pool's refs); returns (the new state, the block's logits [rows, ppb * page]).

    `visible` [rows or 1, ppb * page] masks keys (masked pages may be the null page). q and
    the output are cut into channel parts (`q_parts[dtype]`, carry[0]) at least as fine as
    the tier's packing. With `half` (16-bit `compute` only), quantized sides are dequantized
    in float16 (`_dequantize_f16`) and dotted in float16; else in float32, cast to compute.
    """
    fmt = tier.kv_format
    k_bits, v_bits = fmt.k_bits, fmt.v_bits
    page = tier.page_size
    q_compute = q_parts[compute]
    block_h = q_compute[0].shape[0]
    block_k = pages.shape[0] * page
    dk, dv = q_compute[0].shape[1], carry[0][0].shape[1]
    d = dk * len(q_compute)
    g = min(fmt.group, d)
    dequantize = functools.partial(_dequantize_f16 if half else _dequantize, pages=pages,
                                   group=g, **({} if half else {"page": page}))

    loaded: dict = {}
    logits = jnp.zeros((block_h, block_k), jnp.float32)
    for i in range(len(q_compute)):
        k_i = _load_part(tier.k, pages, k_bits, i, dk, loaded, flat=not half or k_bits == 16)
        if k_bits < 16:
            k_i = dequantize(k_i, tier.k_scale, tier.k_zero, part=i, width=dk,
                             per_token=fmt.token_keys)
        q_i = q_parts[k_i.dtype if half and k_bits < 16 else compute][i]
        logits += dot_t(q_i, k_i.astype(q_i.dtype))

    v_loaded: dict = {}

    def values(i):
        v_i = _load_part(tier.v, pages, v_bits, i, dv, v_loaded, flat=not half or v_bits == 16)
        if v_bits < 16:
            v_i = dequantize(v_i, tier.v_scale, tier.v_zero, part=i, width=dv, per_token=True)
        return v_i if half and v_bits < 16 else v_i.astype(compute)

    return online_update(carry, logits, visible, values), logits


def half_dtypes(compute, formats, half: bool) -> list:
    """The dtypes q is dotted in: `compute`, and float16 where `half` dequantizes a tier's
    quantized keys in float16."""
    return [compute] + ([jnp.float16] if half and any(f.k_bits < 16 for f in formats) else [])


def query_parts(q_ref, parts: int, sm_scale: float, dtypes) -> dict:
    """q [rows, D] times sm_scale as `parts` channel blocks, in each of `dtypes` (the
    compute dtype, and float16 for quantized sides dequantized in float16)."""
    d = q_ref.shape[1]
    width = d // parts
    scaled = [q_ref[:, pl.ds(i * width, width)].astype(jnp.float32) * sm_scale
              for i in range(parts)]
    return {jnp.dtype(dt): [x.astype(dt) for x in scaled] for dt in dtypes}
