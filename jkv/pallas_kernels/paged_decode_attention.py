"""Paged decode attention over full-precision or quantized pages (Pallas, Triton lowering).

One program per (sequence, KV head, split): all query heads of the KV head (GQA) at once,
an online softmax over blocks of pages, dequantization fused into the loop (`page_blocks`).
Long contexts are cut into `k_splits` partitions whose partial results are merged by
log-sum-exp outside the kernel. Scales and zero points are separate arrays indexed by page
id, so a layer that reads another layer's pages passes its own scales (cross-layer sharing
as aliasing).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jkv.kv.pages import KVPages
from jkv.kv.quant import codes_per_byte
from jkv.pallas_kernels.page_blocks import attend_block, half_dtypes, query_parts
from jkv.pallas_kernels.significance import paged_decode_significance
from jkv.pallas_kernels.softmax_state import merge_softmax_states, normalize_softmax_state

MIN_DOT = 16  # compiled Triton dots need every dimension >= 16
DEQUANT = ("f32", "f16")  # the arithmetic quantized pages are dequantized in


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
    attend_pages = functools.partial(attend_block, q_parts=q_parts, compute=compute,
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
    and casts them to q's dtype. On a GPU f16 is the faster of the two and, for 4- and 2-bit
    values, the more accurate (chosen by measurement, see benchmarks/decode_attention.py).
    """
    d = q.shape[2]
    _check_decode_inputs(q, pages, page_table, lengths, k_splits=k_splits,
                         pages_per_block=pages_per_block, interpret=interpret)
    tiers, low_lengths, parts, half = checked_parts(pages, low_tier, low_lengths, lengths, d,
                                                    dequant, q.dtype)
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    o, denom, m, *logits = _decode_pallas_call(
        q, tiers, page_table, lengths, low_lengths, parts=parts, half=half, sm_scale=sm_scale,
        pages_per_block=pages_per_block, k_splits=k_splits, num_warps=num_warps,
        num_stages=num_stages, significance=return_significance, interpret=interpret)
    return _merged_splits(q, o, denom, m, logits, (lengths, low_lengths), page_table.shape[2],
                          softmax_state=return_softmax_state,
                          significance=return_significance, two_tiers=low_tier is not None)


def _check_decode_inputs(q: jax.Array, pages: KVPages, page_table: jax.Array,
                         lengths: jax.Array, *, k_splits: int, pages_per_block: int,
                         interpret: bool) -> None:
    """ValueError for shapes and blocks `paged_decode_attention` cannot run on: the
    kernel indexes its operands blindly."""
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


def _block_h(q: jax.Array, page_table: jax.Array) -> int:
    """Rows of one program: the query heads of a KV head, padded to a power of two and to
    the 16 a Triton dot needs."""
    return max(16, pl.next_power_of_2(q.shape[1] // page_table.shape[1]))


def _decode_pallas_call(q: jax.Array, tiers: list, page_table: jax.Array, lengths: jax.Array,
                        low_lengths: jax.Array, *, parts: tuple, half: bool, sm_scale: float,
                        pages_per_block: int, k_splits: int, num_warps: int, num_stages: int,
                        significance: bool, interpret: bool) -> list:
    """The kernel over a grid of (sequence, KV head, split): each split's unnormalised
    state (o [B, Hkv, k_splits, block_h, D], denominator, max [B, Hkv, k_splits, block_h])
    and with `significance` each tier's logits [B, Hkv, block_h, W * tier page]."""
    kernel = functools.partial(_kernel, formats=tuple(t.kv_format for t in tiers),
                               parts=parts, pages_per_block=pages_per_block,
                               sm_scale=sm_scale, scores=significance, half=half)
    name = "_".join(t.kv_format.name for t in tiers) + ("_f16" if half else "")
    return pl.pallas_call(
        kernel,
        grid=(q.shape[0], page_table.shape[1], k_splits),
        **_decode_specs(q, tiers, page_table, k_splits=k_splits, significance=significance),
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"jkv_paged_decode_{name}{'_sig' if significance else ''}",
    )(*_decode_operands(q, tiers, page_table, lengths, low_lengths))


def _decode_operands(q: jax.Array, tiers: list, page_table: jax.Array, lengths: jax.Array,
                     low_lengths: jax.Array) -> list:
    """The kernel's operands, in the order it pops them: q grouped by KV head with its rows
    padded to block_h, each tier's pool arrays, the page table and both tiers' lengths."""
    b, hq, d = q.shape
    hkv = page_table.shape[1]
    group_size = hq // hkv
    qg = q.reshape(b, hkv, group_size, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, _block_h(q, page_table) - group_size), (0, 0)))
    args = [qg]
    for tier in tiers:  # in the order the kernel reads them back (`from_operands`)
        args += tier.operands()
    lens = jnp.stack([lengths, low_lengths], axis=-1).astype(jnp.int32)
    return args + [page_table.astype(jnp.int32), lens]


def _decode_specs(q: jax.Array, tiers: list, page_table: jax.Array, *, k_splits: int,
                  significance: bool) -> dict:
    """`pl.pallas_call`'s in_specs, out_specs and out_shape for `_decode_operands` on the
    grid (sequence, KV head, split): a program reads its row of q, table and lengths and
    the whole pools, and writes its split's state (and its columns' logits)."""
    b, _, d = q.shape
    hkv, w = page_table.shape[1:]
    block_h = _block_h(q, page_table)
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    specs = [pl.BlockSpec((None, None, block_h, d), lambda i, h, s: (i, h, 0, 0))]
    for tier in tiers:
        specs += [full(x) for x in tier.operands()]
    specs += [pl.BlockSpec((None, None, w), lambda i, h, s: (i, h, 0)),
              pl.BlockSpec((None, None, 2), lambda i, h, s: (i, h, 0))]
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
    if significance:  # each split writes its own columns' logits, per tier
        for tier in tiers:
            per_split = w // k_splits * tier.page_size
            out_specs.append(pl.BlockSpec((None, None, block_h, per_split),
                                          lambda i, h, s: (i, h, 0, s)))
            out_shape.append(jax.ShapeDtypeStruct((b, hkv, block_h, w * tier.page_size),
                                                  jnp.float32))
    return dict(in_specs=specs, out_specs=out_specs, out_shape=out_shape)


def _merged_splits(q: jax.Array, o: jax.Array, denom: jax.Array, m: jax.Array, logits: list,
                   lengths: tuple, w: int, *, softmax_state: bool, significance: bool,
                   two_tiers: bool) -> jax.Array | tuple:
    """`paged_decode_attention`'s result from the kernel's splits: merged by log-sum-exp,
    the padding rows cut, normalised unless `softmax_state`, with the tiers' significance
    when asked."""
    b, hq, d = q.shape
    group_size = hq // o.shape[1]
    o, denom, m = merge_softmax_states(o, denom, m, axis=2)
    o, denom, m = o[:, :, :group_size], denom[:, :, :group_size], m[:, :, :group_size]
    if significance:
        sig = paged_decode_significance(logits, m, denom, lengths, w, softmax_state)
        sig = tuple(sig) if two_tiers else sig[0]
    o, denom, m = o.reshape(b, hq, d), denom.reshape(b, hq), m.reshape(b, hq)
    out = (o, denom, m) if softmax_state else normalize_softmax_state(o, denom).astype(q.dtype)
    return (out, sig) if significance else out


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
    k, v, visible, n_high = dequantized_tiers(pages, page_table, lengths, low_tier, low_lengths)
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


def dequantized_tiers(pages: KVPages, page_table: jax.Array, lengths: jax.Array,
                      low_tier: KVPages | None = None,
                      low_lengths: jax.Array | None = None) -> tuple:
    """What the references attend over: every row's pages dequantized to float32, the low
    tier's (read right to left) after the high tier's, as keys and values [B, Hkv, S, D],
    the tokens held [B, Hkv, S] and the high tier's S."""
    k, v = dequantized_rows(pages, page_table)
    n_high = k.shape[2]
    visible = jnp.arange(n_high)[None, None, :] < lengths[:, :, None]
    if low_tier is not None:
        k_lo, v_lo = dequantized_rows(low_tier, page_table[..., ::-1])
        k, v = jnp.concatenate([k, k_lo], axis=2), jnp.concatenate([v, v_lo], axis=2)
        visible = jnp.concatenate(
            [visible, jnp.arange(k_lo.shape[2])[None, None, :] < low_lengths[:, :, None]], -1)
    return k, v, visible, n_high
