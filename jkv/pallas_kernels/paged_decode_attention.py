"""Paged decode attention over full-precision or quantized pages (Pallas, Triton lowering).

One program per (sequence, KV head, split): all query heads of the KV head (GQA) at once,
an online softmax over blocks of pages, dequantization fused into the loop. Long contexts
are cut into `k_splits` partitions whose partial results are merged by log-sum-exp outside
the kernel. Scales and zero points are separate arrays indexed by page id, so a layer that
reads another layer's pages passes its own scales (cross-layer sharing as aliasing).

Layout (see `kv_quant`): b-bit codes are packed k = 8 // b per byte along channels, "part" i
of a byte holding the channel block [i * D/k, (i + 1) * D/k). The kernel dots each part with
the matching slice of q, so no interleaving or concatenation happens on the GPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jkv.pallas_kernels.kv_quant import codes_per_byte, dequantize_keys, dequantize_values

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def _dot_t(a: jax.Array, b: jax.Array) -> jax.Array:
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


def _kernel(*refs, k_bits: int, v_bits: int, group: int, pages_per_block: int,
            sm_scale: float):
    refs = list(refs)
    q_ref = refs.pop(0)  # [block_h, D]
    k_ref = refs.pop(0)  # [P, page, D // kk]: model dtype, or uint8 codes
    ks_ref, kz_ref = (refs.pop(0), refs.pop(0)) if k_bits < 16 else (None, None)  # [P, D]
    v_ref = refs.pop(0)  # [P, page, D // kv]
    vs_ref, vz_ref = (refs.pop(0), refs.pop(0)) if v_bits < 16 else (None, None)  # [P, page, G]
    table_ref = refs.pop(0)  # [pages_per_split]
    len_ref = refs.pop(0)  # [1]
    o_ref, l_ref, m_ref = refs  # [block_h, D] f32, [block_h], [block_h]

    split = pl.program_id(2)
    block_h, d = q_ref.shape
    page = k_ref.shape[1]
    pages_per_split = table_ref.shape[0]
    block_k = pages_per_block * page
    kk = codes_per_byte(k_bits) if k_bits < 16 else 1
    kv = codes_per_byte(v_bits) if v_bits < 16 else 1
    dk, dv = d // kk, d // kv
    compute = q_ref.dtype  # bf16 operands use the tensor cores; f32 ones stay IEEE
    q_parts = [(q_ref[:, pl.ds(i * dk, dk)].astype(jnp.float32) * sm_scale).astype(compute)
               for i in range(kk)]

    length = len_ref[0]
    first_page = split * pages_per_split
    end_page = jnp.minimum(pl.cdiv(length, page), first_page + pages_per_split)

    def body(j, carry):
        o_parts, m_prev, l_prev = carry
        pages = table_ref[pl.ds(j * pages_per_block, pages_per_block)]

        # scores [block_h, block_k]
        k_codes = k_ref[pages].reshape(block_k, dk)
        logits = jnp.zeros((block_h, block_k), jnp.float32)
        for i in range(kk):
            if k_bits == 16:
                k_i = k_codes.astype(compute)
            else:
                c = ((k_codes >> (k_bits * i)) & ((1 << k_bits) - 1)).astype(jnp.float32)
                scale = _expand_pages(ks_ref[pages, pl.ds(i * dk, dk)], page)
                zero = _expand_pages(kz_ref[pages, pl.ds(i * dk, dk)], page)
                k_i = (c * scale + zero).astype(compute)
            logits += _dot_t(q_parts[i], k_i)
        token = (first_page + j * pages_per_block) * page + jnp.arange(block_k)
        logits = jnp.where((token < length)[None, :], logits, MASK_VALUE)

        m_next = jnp.maximum(m_prev, logits.max(axis=-1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.exp(logits - m_next[:, None])
        l_next = correction * l_prev + p.sum(axis=-1)
        p = p.astype(compute)

        v_codes = v_ref[pages].reshape(block_k, dv)
        new_parts = []
        for i in range(kv):
            if v_bits == 16:
                v_i = v_codes.astype(compute)
            else:
                c = ((v_codes >> (v_bits * i)) & ((1 << v_bits) - 1)).astype(jnp.float32)
                g = min(group, d)
                n = max(dv // g, 1)  # groups inside this channel block
                first = (i * dv) // g
                scale = vs_ref[pages, :, pl.ds(first, n)].reshape(block_k, n)
                zero = vz_ref[pages, :, pl.ds(first, n)].reshape(block_k, n)
                width = min(g, dv)
                scale = jnp.broadcast_to(scale[:, :, None], (block_k, n, width)).reshape(
                    block_k, dv)
                zero = jnp.broadcast_to(zero[:, :, None], (block_k, n, width)).reshape(
                    block_k, dv)
                v_i = (c * scale + zero).astype(compute)
            new_parts.append(correction[:, None] * o_parts[i] + _dot(p, v_i))
        return tuple(new_parts), m_next, l_next

    o0 = tuple(jnp.zeros((block_h, dv), jnp.float32) for _ in range(kv))
    m0 = jnp.full((block_h,), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((block_h,), jnp.float32)
    num_blocks = pl.cdiv(jnp.maximum(end_page - first_page, 0), pages_per_block)
    o_parts, m, denom = lax.fori_loop(0, num_blocks, body, (o0, m0, l0))
    for i in range(kv):
        o_ref[:, pl.ds(i * dv, dv)] = o_parts[i]
    l_ref[...] = denom
    m_ref[...] = m


@functools.partial(jax.jit, static_argnames=(
    "k_bits", "v_bits", "group", "sm_scale", "pages_per_block", "k_splits", "num_warps",
    "num_stages", "interpret"))
def paged_decode_attention(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [P, page, D // (8 // k_bits)] uint8, or [P, page, D] model dtype
    v_pages: jax.Array,  # [P, page, D // (8 // v_bits)] uint8, or [P, page, D] model dtype
    page_table: jax.Array,  # int32 [B, Hkv, W]
    lengths: jax.Array,  # int32 [B, Hkv]: tokens per (sequence, KV head)
    k_scale: jax.Array | None = None,  # f32 [P, D]
    k_zero: jax.Array | None = None,  # f32 [P, D]
    v_scale: jax.Array | None = None,  # f32 [P, page, D // group]
    v_zero: jax.Array | None = None,  # f32 [P, page, D // group]
    *,
    k_bits: int = 16,
    v_bits: int = 16,
    group: int = 64,
    sm_scale: float | None = None,
    pages_per_block: int = 4,
    k_splits: int = 1,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """softmax(q K^T * sm_scale) V for one decode token per sequence; returns [B, Hq, D]."""
    b, hq, d = q.shape
    bt, hkv, w = page_table.shape
    if bt != b or lengths.shape != (b, hkv):
        raise ValueError(f"page_table {page_table.shape} and lengths {lengths.shape} must be "
                         f"[B={b}, Hkv, W] and [B, Hkv]")
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of KV heads {hkv}")
    if w % (k_splits * pages_per_block):
        raise ValueError(f"page-table width {w} must be a multiple of k_splits * "
                         f"pages_per_block = {k_splits * pages_per_block}")
    for name, bits, pages in (("k", k_bits, k_pages), ("v", v_bits, v_pages)):
        per = codes_per_byte(bits) if bits < 16 else 1
        if pages.shape[-1] * per != d:
            raise ValueError(f"{name}_pages last dim {pages.shape[-1]} does not hold head_dim "
                             f"{d} at {bits} bits")
        if bits < 16 and pages.dtype != jnp.uint8:
            raise ValueError(f"{name}_pages must be uint8 codes at {bits} bits, "
                             f"got {pages.dtype}")
    if (k_bits < 16) != (k_scale is not None and k_zero is not None):
        raise ValueError("k_scale and k_zero are required exactly when k_bits < 16")
    if (v_bits < 16) != (v_scale is not None and v_zero is not None):
        raise ValueError("v_scale and v_zero are required exactly when v_bits < 16")
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    group_size = hq // hkv
    block_h = max(16, pl.next_power_of_2(group_size))
    qg = q.reshape(b, hkv, group_size, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, block_h - group_size), (0, 0)))
    pages_per_split = w // k_splits
    table = page_table.reshape(b, hkv, k_splits, pages_per_split)
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731

    args = [qg, k_pages]
    specs = [pl.BlockSpec((None, None, block_h, d), lambda i, h, s: (i, h, 0, 0)),
             full(k_pages)]
    if k_bits < 16:
        args += [k_scale, k_zero]
        specs += [full(k_scale), full(k_zero)]
    args.append(v_pages)
    specs.append(full(v_pages))
    if v_bits < 16:
        args += [v_scale, v_zero]
        specs += [full(v_scale), full(v_zero)]
    args += [table, lengths.reshape(b, hkv, 1).astype(jnp.int32)]
    specs += [pl.BlockSpec((None, None, None, pages_per_split), lambda i, h, s: (i, h, s, 0)),
              pl.BlockSpec((None, None, 1), lambda i, h, s: (i, h, 0))]

    kernel = functools.partial(_kernel, k_bits=k_bits, v_bits=v_bits, group=group,
                               pages_per_block=pages_per_block, sm_scale=sm_scale)
    o, denom, m = pl.pallas_call(
        kernel,
        grid=(b, hkv, k_splits),
        in_specs=specs,
        out_specs=[
            pl.BlockSpec((None, None, None, block_h, d), lambda i, h, s: (i, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, block_h), lambda i, h, s: (i, h, s, 0)),
            pl.BlockSpec((None, None, None, block_h), lambda i, h, s: (i, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, k_splits, block_h, d), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, k_splits, block_h), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, k_splits, block_h), jnp.float32),
        ],
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"jkv_paged_decode_k{k_bits}v{v_bits}",
    )(*args)
    return merge_splits(o, denom, m)[:, :, :group_size].reshape(b, hq, d).astype(q.dtype)


def merge_splits(o: jax.Array, denom: jax.Array, m: jax.Array) -> jax.Array:
    """Combine per-split (unnormalised o [..., S, H, D], softmax denominators and maxima
    [..., S, H]) by log-sum-exp."""
    m_all = m.max(axis=-2, keepdims=True)
    m_all = jnp.where(jnp.isfinite(m_all), m_all, 0.0)
    w = jnp.exp(m - m_all)  # splits with no tokens have m = -inf: weight 0
    num = (o * w[..., None]).sum(axis=-3)
    den = (denom * w).sum(axis=-2)
    return num / jnp.where(den > 0, den, 1.0)[..., None]


def paged_decode_attention_reference(q, k_pages, v_pages, page_table, lengths, k_scale=None,
                                     k_zero=None, v_scale=None, v_zero=None, *, k_bits=16,
                                     v_bits=16, sm_scale=None, dtype=jnp.float32):
    """The same function in plain jnp: dequantize every page of every row, masked softmax."""
    b, hq, d = q.shape
    hkv = page_table.shape[1]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    k, v = dequantized_rows(k_pages, v_pages, page_table, k_scale, k_zero, v_scale, v_zero,
                            k_bits=k_bits, v_bits=v_bits)
    k, v = k.astype(dtype), v.astype(dtype)  # [B, Hkv, S, D]
    qg = q.astype(dtype).reshape(b, hkv, hq // hkv, d) * sm_scale
    s = jnp.einsum("bhgd,bhsd->bhgs", qg, k, precision=lax.Precision.HIGHEST)
    visible = jnp.arange(k.shape[2])[None, None, :] < lengths[:, :, None]
    s = jnp.where(visible[:, :, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bhgs,bhsd->bhgd", p, v, precision=lax.Precision.HIGHEST)
    return out.reshape(b, hq, d)


def dequantized_rows(k_pages, v_pages, page_table, k_scale=None, k_zero=None, v_scale=None,
                     v_zero=None, *, k_bits=16, v_bits=16):
    """Every row's pages dequantized to float32, in table order: ([B, Hkv, W*page, D]) x 2."""
    b, hkv, w = page_table.shape
    page = k_pages.shape[1]
    if k_bits < 16:
        k = dequantize_keys(k_pages[page_table], k_scale[page_table], k_zero[page_table], k_bits)
    else:
        k = k_pages[page_table].astype(jnp.float32)
    if v_bits < 16:
        v = dequantize_values(v_pages[page_table], v_scale[page_table], v_zero[page_table],
                              v_bits)
    else:
        v = v_pages[page_table].astype(jnp.float32)
    return k.reshape(b, hkv, w * page, -1), v.reshape(b, hkv, w * page, -1)
