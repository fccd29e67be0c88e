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

from jkv.kv.pages import KVPages
from jkv.kv.quant import codes_per_byte
from jkv.pallas_kernels.softmax_state import merge_softmax_states, normalize_softmax_state

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
MIN_DOT = 16  # compiled Triton dots need every dimension >= 16
DEQUANT = ("f32", "f16")  # the arithmetic quantized pages are dequantized in


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


def _online_update(carry, logits, visible, values):
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
    float32 and back to 16 bits; on the H200 this one decodes 1.0x-1.3x as fast)."""
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


def _attend_pages(carry, tier: KVPages, pages, visible, *, q_parts: dict, compute,
                  half: bool = False):
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
        logits += _dot_t(q_i, k_i.astype(q_i.dtype))

    v_loaded: dict = {}

    def values(i):
        v_i = _load_part(tier.v, pages, v_bits, i, dv, v_loaded, flat=not half or v_bits == 16)
        if v_bits < 16:
            v_i = dequantize(v_i, tier.v_scale, tier.v_zero, part=i, width=dv, per_token=True)
        return v_i if half and v_bits < 16 else v_i.astype(compute)

    return _online_update(carry, logits, visible, values), logits


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


def _kernel(*refs, formats: tuple, parts: tuple, pages_per_block: int, sm_scale: float,
            scores: bool, half: bool):
    refs = list(refs)
    q_ref = refs.pop(0)  # [block_h, D]
    # the pool refs [P, page, ...] of the high tier, then of the low tier if any
    tiers = [KVPages.from_operands(f, refs) for f in formats]
    table_ref = refs.pop(0)  # [W]: the whole page-table row of this (sequence, KV head)
    len_ref = refs.pop(0)  # [2]: tokens in the high tier, tokens in the low tier
    o_ref, l_ref, m_ref = refs[:3]  # [block_h, D] f32, [block_h], [block_h]
    # with `scores`: per tier, the logits [block_h, per_split * tier page] of this split's
    # columns (columns never visited are left unwritten; the caller masks them)
    s_refs = refs[3:] if scores else [None] * len(tiers)

    block_h, d = q_ref.shape
    w = table_ref.shape[0]
    ppb = pages_per_block
    per_split = w // pl.num_programs(2)
    first = pl.program_id(2) * per_split
    last = first + per_split
    nk, nv = parts
    dv = d // nv
    compute = q_ref.dtype  # bf16 operands use the tensor cores; f32 ones stay IEEE
    q_parts = query_parts(q_ref, nk, sm_scale, half_dtypes(compute, formats, half))
    attend_pages = functools.partial(_attend_pages, q_parts=q_parts, compute=compute,
                                     half=half)

    def attend(carry, tier, s_ref, pages, visible, col):
        carry, logits = attend_pages(carry, tier, pages, visible)
        if s_ref is not None:
            s_ref[:, pl.ds((col - first) * tier.page_size, ppb * tier.page_size)] = logits
        return carry
    carry = (tuple(jnp.zeros((block_h, dv), jnp.float32) for _ in range(nv)),
             jnp.full((block_h,), -jnp.inf, jnp.float32), jnp.zeros((block_h,), jnp.float32))

    # high tier: pages from the left of the row, in slot order
    page = tiers[0].page_size
    len_hi = len_ref[0]
    end_hi = jnp.minimum(pl.cdiv(len_hi, page), last)

    def hi_body(j, carry):
        col = first + j * ppb
        pages = jnp.where(col + jnp.arange(ppb) < end_hi, table_ref[pl.ds(col, ppb)], 0)
        token = col * page + jnp.arange(ppb * page)
        return attend(carry, tiers[0], s_refs[0], pages, (token < len_hi)[None, :], col)

    carry = lax.fori_loop(0, pl.cdiv(jnp.maximum(end_hi - first, 0), ppb), hi_body, carry)

    if len(tiers) > 1:
        # low tier: pages of its own size from the right of the row, low page i at column
        # w - 1 - i
        page_lo = tiers[1].page_size
        len_lo = len_ref[1]
        start_lo = jnp.maximum(w - pl.cdiv(len_lo, page_lo), first)
        offset = jnp.arange(ppb * page_lo) % page_lo

        def lo_body(j, carry):
            col = first + j * ppb
            pages = jnp.where(col + jnp.arange(ppb) >= start_lo, table_ref[pl.ds(col, ppb)], 0)
            col_tok = col + jnp.arange(ppb * page_lo) // page_lo
            token = jnp.where(col_tok >= start_lo, (w - 1 - col_tok) * page_lo + offset, len_lo)
            return attend(carry, tiers[1], s_refs[1], pages, (token < len_lo)[None, :], col)

        carry = lax.fori_loop((start_lo - first) // ppb, pl.cdiv(per_split, ppb), lo_body,
                              carry)

    o_parts, m, denom = carry
    for i in range(nv):
        o_ref[:, pl.ds(i * dv, dv)] = o_parts[i]
    l_ref[...] = denom
    m_ref[...] = m


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "pages_per_block", "k_splits", "num_warps", "num_stages",
    "return_softmax_state", "return_significance", "dequant", "interpret"))
def paged_decode_attention(
    q: jax.Array,  # [B, Hq, D]
    pages: KVPages,  # the pool [P, page, ...]
    page_table: jax.Array,  # int32 [B, Hkv, W]
    lengths: jax.Array,  # int32 [B, Hkv]: tokens per (sequence, KV head)
    *,
    sm_scale: float | None = None,
    pages_per_block: int = 4,
    k_splits: int = 1,
    num_warps: int = 4,
    num_stages: int = 2,
    low_tier: KVPages | None = None,  # a second pool [P', page, ...], in its own format
    low_lengths: jax.Array | None = None,  # int32 [B, Hkv]: tokens in the low tier
    return_softmax_state: bool = False,
    return_significance: bool = False,
    dequant: str = "f16",
    interpret: bool = False,
):
    """softmax(q K^T * sm_scale) V for one decode token per sequence; returns [B, Hq, D].

    The high tier's pages fill each page-table row from the left (slot j of the tier in
    column j // page). With `low_tier`, a second tier's pages fill the same row from the
    right (LeanKV's bidirectional table: low page i at column W - 1 - i), in their own format
    and page size (a multiple of the high tier's: the same bytes read at half the bits hold
    twice the tokens, `KVPages.as_format`); the kernel walks high pages, then low ones. With
    `return_softmax_state` it returns the unnormalised state (o [B, Hq, D] f32, denominator
    [B, Hq], row max [B, Hq]) for `merge_softmax_states`.
    With `return_significance` it returns (that result, significance): LeanKV's significance
    of every key, the attention it receives, max over the query heads of its KV head,
    float32 [B, Hkv, W * page] in slot order (0 where no token is held); with a low tier a
    pair (high, low [B, Hkv, W * low page]), each in its tier's slot order. The kernel writes
    its logits in the same pass over the pages; they are normalised after the splits merge.
    With both flags, significance is per query head and unnormalised like o,
    exp(logit - row max) [B, Hq, ...], so a caller merging states rescales it the same way
    before taking the max over each KV head's query heads.
    `dequant` (16-bit q only; float32 q always runs in float32): "f16" makes codes float16 by
    their bit pattern, scales them in float16 and dots them in float16 (q cast to float16
    once), with no int-to-float conversion per element; "f32" dequantizes codes in float32
    and casts them to q's dtype. On the H200 at batch 64 x 8K-32K f16 ran 1.01x-1.33x bf16's
    speed against f32's 0.93x-1.08x, at a third to a fifth of its error for 4- and 2-bit
    values (benchmarks/results/kernels-sweep-NVIDIA_H200-2026-11-27-dequant*.json).
    """
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
    if not interpret and pages_per_block * pages.page_size < MIN_DOT:
        raise ValueError(f"pages_per_block * page = {pages_per_block} * {pages.page_size} "
                         f"must be >= {MIN_DOT} on a GPU (Triton dots need 16 along each "
                         "dimension)")
    pages.check(d)
    tiers, low_lengths, parts, half = checked_parts(pages, low_tier, low_lengths, lengths, d,
                                                    dequant, q.dtype)
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    group_size = hq // hkv
    block_h = max(16, pl.next_power_of_2(group_size))
    qg = q.reshape(b, hkv, group_size, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, block_h - group_size), (0, 0)))
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731

    args = [qg]
    specs = [pl.BlockSpec((None, None, block_h, d), lambda i, h, s: (i, h, 0, 0))]
    for tier in tiers:  # in the order the kernel reads them back (`from_operands`)
        args += tier.operands()
        specs += [full(x) for x in tier.operands()]
    lens = jnp.stack([lengths, low_lengths], axis=-1).astype(jnp.int32)
    args += [page_table.astype(jnp.int32), lens]
    specs += [pl.BlockSpec((None, None, w), lambda i, h, s: (i, h, 0)),
              pl.BlockSpec((None, None, 2), lambda i, h, s: (i, h, 0))]

    kernel = functools.partial(_kernel, formats=tuple(t.kv_format for t in tiers),
                               parts=parts, pages_per_block=pages_per_block,
                               sm_scale=sm_scale, scores=return_significance, half=half)
    name = "_".join(t.kv_format.name for t in tiers) + ("_f16" if half else "")
    out_specs = [
        pl.BlockSpec((None, None, None, block_h, d), lambda i, h, s: (i, h, s, 0, 0)),
        pl.BlockSpec((None, None, None, block_h), lambda i, h, s: (i, h, s, 0)),
        pl.BlockSpec((None, None, None, block_h), lambda i, h, s: (i, h, s, 0)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((b, hkv, k_splits, block_h, d), jnp.float32),
        jax.ShapeDtypeStruct((b, hkv, k_splits, block_h), jnp.float32),
        jax.ShapeDtypeStruct((b, hkv, k_splits, block_h), jnp.float32),
    ]
    if return_significance:  # each split writes its own columns' logits, per tier
        for tier in tiers:
            per_split = w // k_splits * tier.page_size
            out_specs.append(pl.BlockSpec((None, None, block_h, per_split),
                                          lambda i, h, s: (i, h, 0, s)))
            out_shape.append(jax.ShapeDtypeStruct((b, hkv, block_h, w * tier.page_size),
                                                  jnp.float32))
    o, denom, m, *logits = pl.pallas_call(
        kernel,
        grid=(b, hkv, k_splits),
        in_specs=specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"jkv_paged_decode_{name}{'_sig' if return_significance else ''}",
    )(*args)
    o, denom, m = merge_softmax_states(o, denom, m, axis=2)
    o, denom, m = o[:, :, :group_size], denom[:, :, :group_size], m[:, :, :group_size]
    if return_significance:
        significance = []
        for i, s in enumerate(logits):
            s = s[:, :, :group_size]
            if i:  # low pages from the right: reversed columns are slot order
                s = s.reshape(b, hkv, group_size, w, -1)[:, :, :, ::-1].reshape(s.shape)
            held = jnp.arange(s.shape[-1]) < (lengths, low_lengths)[i][:, :, None, None]
            p = jnp.where(held, jnp.exp(s - m[..., None]), 0.0)
            if return_softmax_state:  # unnormalised per query head, like o
                significance.append(p.reshape(b, hq, -1))
            else:
                significance.append(
                    (p / jnp.where(denom > 0, denom, 1.0)[..., None]).max(axis=2))
        significance = tuple(significance) if low_tier is not None else significance[0]
    o, denom, m = o.reshape(b, hq, d), denom.reshape(b, hq), m.reshape(b, hq)
    out = (o, denom, m) if return_softmax_state else normalize_softmax_state(o, denom).astype(
        q.dtype)
    return (out, significance) if return_significance else out


def checked_tiers(pages: KVPages, low_tier: KVPages | None, low_lengths: jax.Array | None,
                  lengths: jax.Array, d: int,
                  group_parts: bool = False) -> tuple[list[KVPages], jax.Array, tuple]:
    """The tiers a kernel walks (the high one, and the low one if given), the low tier's
    lengths (zeros without one) and the channel parts (keys, values) fine enough for every
    tier's packing, and with `group_parts` inside one scale group of every per-token
    quantized side; ValueError for a low tier that does not fit the high one."""
    tiers = [pages]
    if low_tier is not None:
        if low_lengths is None or low_lengths.shape != lengths.shape:
            raise ValueError(f"low_lengths must be [B, Hkv]={list(lengths.shape)} with "
                             f"low_tier, got {None if low_lengths is None else low_lengths.shape}")
        low_tier.check(d, "low_tier")
        if low_tier.page_size % pages.page_size:
            raise ValueError(f"the low tier's page size {low_tier.page_size} is not a "
                             f"multiple of the high tier's {pages.page_size}")
        tiers.append(low_tier)
    else:
        low_lengths = jnp.zeros_like(lengths)

    def side_parts(fmt, side: int) -> int:
        bits = (fmt.k_bits, fmt.v_bits)[side]
        if bits == 16:
            return 1
        per_token = side == 1 or fmt.token_keys
        groups = d // min(fmt.group, d) if group_parts and per_token else 1
        return max(codes_per_byte(bits), groups)

    parts = tuple(max(side_parts(t.kv_format, i) for t in tiers) for i in range(2))
    return tiers, low_lengths, parts


def checked_parts(pages: KVPages, low_tier: KVPages | None, low_lengths: jax.Array | None,
                  lengths: jax.Array, d: int, dequant: str,
                  dtype) -> tuple[list[KVPages], jax.Array, tuple, bool]:
    """`checked_tiers` and whether quantized sides are dequantized in float16: for 16-bit
    queries with dequant "f16", where every channel part (then cut inside one scale group)
    keeps at least MIN_DOT channels (a narrower dot would sum wrongly on a GPU: such groups
    keep the float32 path)."""
    if dequant not in DEQUANT:
        raise ValueError(f"dequant must be one of {DEQUANT}, got {dequant!r}")
    half = dequant == "f16" and dtype != jnp.float32
    tiers, low_lengths, parts = checked_tiers(pages, low_tier, low_lengths, lengths, d,
                                              group_parts=half)
    if half and d // max(parts) < MIN_DOT:
        half = False
        tiers, low_lengths, parts = checked_tiers(pages, low_tier, low_lengths, lengths, d)
    return tiers, low_lengths, parts, half


def paged_decode_attention_reference(q: jax.Array, pages: KVPages, page_table: jax.Array,
                                     lengths: jax.Array, *, sm_scale: float | None = None,
                                     low_tier: KVPages | None = None,
                                     low_lengths: jax.Array | None = None,
                                     dtype=jnp.float32, return_significance: bool = False):
    """The same function in plain jnp: dequantize every page of every row (the low tier's
    read right to left), one masked softmax over both tiers. With `return_significance`,
    also the probabilities' max over each KV head's query heads in slot order (a pair of
    high and low with a low tier)."""
    b, hq, d = q.shape
    hkv = page_table.shape[1]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    k, v = dequantized_rows(pages, page_table)
    n_high = k.shape[2]
    visible = jnp.arange(k.shape[2])[None, None, :] < lengths[:, :, None]
    if low_tier is not None:
        k_lo, v_lo = dequantized_rows(low_tier, page_table[..., ::-1])
        k, v = jnp.concatenate([k, k_lo], axis=2), jnp.concatenate([v, v_lo], axis=2)
        visible = jnp.concatenate(
            [visible, jnp.arange(k_lo.shape[2])[None, None, :] < low_lengths[:, :, None]], -1)
    k, v = k.astype(dtype), v.astype(dtype)  # [B, Hkv, S, D]
    qg = q.astype(dtype).reshape(b, hkv, hq // hkv, d) * sm_scale
    s = jnp.einsum("bhgd,bhsd->bhgs", qg, k, precision=lax.Precision.HIGHEST)
    s = jnp.where(visible[:, :, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bhgs,bhsd->bhgd", p, v, precision=lax.Precision.HIGHEST)
    out = out.reshape(b, hq, d)
    if not return_significance:
        return out
    sig = jnp.where(visible[:, :, None, :], p, 0.0).max(axis=2)  # [B, Hkv, S]
    if low_tier is None:
        return out, sig
    return out, (sig[..., :n_high], sig[..., n_high:])


def dequantized_rows(pages: KVPages, page_table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Every row's pages dequantized to float32, in table order: ([B, Hkv, W*page, D]) x 2."""
    b, hkv, w = page_table.shape
    k, v = pages.take(page_table).dense()
    return k.reshape(b, hkv, w * pages.page_size, -1), v.reshape(b, hkv, w * pages.page_size, -1)
