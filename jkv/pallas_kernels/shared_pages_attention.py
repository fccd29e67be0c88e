"""Attention over shared-layer pages (Pallas, Triton lowering): a layer's queries against a
history held as coefficient pages its group of layers shares (`jkv.kv.shared_pages`).

One program per (sequence, KV head): all query rows of the KV head (a prefill chunk's
positions times the GQA group, or one decode token's group) at once, an online softmax over
blocks of pages. Per block the kernel dequantizes the key coefficients and multiplies them by
the layer's key basis twice, for the key and for its rotate-half (the basis with its halves
swapped, `rotate_half` being linear), then rotates by the tokens' positions computed in the
kernel: the history's keys are never written anywhere. Values are never rebuilt per token:
the softmax weights meet the value coefficients (o = sum p_t c_t, in the rank's space), and
the value basis and mean are applied once at the end (sum p_t (c_t B + mu) = (sum p_t c_t) B
+ (sum p_t) mu). The history precedes every query, so nothing is masked but past its length.
The result is the unnormalised softmax state, to merge with the attention over the rest of
the context (the sink tokens and the pages written since, in the pool's format) by
`softmax_state.merge_softmax_states`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jkv.kv.quant import codes_per_byte, unpack
from jkv.kv.shared_pages import CoefficientPages, LayerBases, part_width
from jkv.pallas_kernels.page_blocks import (
    _dequantize,
    _dot,
    _load_part,
    dot_t,
    online_update,
)
from jkv.pallas_kernels.softmax_state import merge_softmax_states, normalize_softmax_state

MIN_DOT = 16


def _coefficients(ref, scale_ref, zero_ref, pages, bits: int, part: int, width: int,
                  cache: dict, page: int) -> jax.Array:
    """Rank columns [part * width, (part + 1) * width) of pages [ppb], float32 [ppb * page,
    width]."""
    codes = _load_part(ref, pages, bits, part, width, cache)
    return _values(codes, scale_ref, zero_ref, pages, bits, part, width, page)


def _values(codes, scale_ref, zero_ref, pages, bits: int, part, width: int, page: int
            ) -> jax.Array:
    """Unpacked codes [ppb * page, width] of rank part `part` (a Python int or traced) as
    float32 coefficients: 16-bit ones as they are, others scaled per (page, column)."""
    if bits == 16:
        return codes.astype(jnp.float32)
    return _dequantize(codes, scale_ref, zero_ref, pages, part, width, page=page,
                       per_token=False, group=1)


def _rebuild_keys(kc_ref, ks_ref, kz_ref, kb_ref, kr_ref, km_ref, kmr_ref, pages,
                  bits: int, width: int, basis_dtype) -> tuple[jax.Array, jax.Array]:
    """The keys of pages [ppb] before their rotation, and their rotate-half, float32 [ppb *
    page, D]: the mean plus the coefficients times the basis, `width` rank columns a dot.
    The rank is walked in a loop over the packed byte columns (each load's codes unpacked
    into every part it holds), not unrolled: unrolled, each part's basis slice is the same
    at every block of pages, so the compiler hoists every slice out of the loop over blocks
    and keeps all of them in shared memory at once (at a large rank, more than a block
    has)."""
    page = kc_ref.shape[1]
    rows = pages.shape[0] * page
    per_byte = codes_per_byte(bits) if bits < 16 else 1
    spans = kc_ref.shape[-1] // width  # byte columns of `width` codes in a packed row

    def span(o, acc):
        key, half = acc
        codes = kc_ref[pages, :, pl.ds(o * width, width)].reshape(rows, width)
        for shift in range(per_byte):
            part = shift * spans + o
            c = codes if per_byte == 1 else (codes >> (bits * shift)) & ((1 << bits) - 1)
            c = _values(c, ks_ref, kz_ref, pages, bits, part, width, page).astype(basis_dtype)
            key += _dot(c, kb_ref[pl.ds(part * width, width), :].astype(basis_dtype))
            half += _dot(c, kr_ref[pl.ds(part * width, width), :].astype(basis_dtype))
        return key, half

    d = kb_ref.shape[1]
    start = (km_ref[...] + jnp.zeros((rows, d), jnp.float32),
             kmr_ref[...] + jnp.zeros((rows, d), jnp.float32))
    return lax.fori_loop(0, spans, span, start)


def _kernel(q_ref, kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, kt_ref, vt_ref, len_ref,
            inv_ref, kb_ref, kr_ref, km_ref, kmr_ref, vb_ref, vm_ref, o_ref, l_ref, m_ref, *,
            k_bits: int, v_bits: int, pages_per_block: int, rank_block: int, sm_scale: float):
    # q_ref [rows, D]; kc/vc_ref [P, page, packed]; ks/kz/vs/vz_ref [P, R]; kt/vt_ref [W]:
    # the pages of the key and of the value group;
    # len_ref [2]: history tokens, position of the first; inv_ref [1, D]: inverse frequencies
    # (halves repeated); kb/kr_ref [R_k, D]: this KV head's key basis and its rotate-half;
    # km/kmr_ref [1, D] float32; vb_ref [R_v, D]; vm_ref [1, D]; out: o [rows, D], l, m [rows]
    rows = q_ref.shape[0]
    page = kc_ref.shape[1]
    ppb = pages_per_block
    wk = min(part_width(ks_ref.shape[1], k_bits), rank_block)  # rank columns per dot
    wv = min(part_width(vs_ref.shape[1], v_bits), rank_block)
    nv = vs_ref.shape[1] // wv
    basis_dtype = kb_ref.dtype if q_ref.dtype != jnp.float32 else jnp.float32
    q = (q_ref[...].astype(jnp.float32) * sm_scale).astype(q_ref.dtype)
    length, first_position = len_ref[0], len_ref[1]
    coefficients = functools.partial(_coefficients, page=page)

    # this split's columns of the table: [first, last)
    per_split = kt_ref.shape[0] // pl.num_programs(2)
    first = pl.program_id(2) * per_split
    end = jnp.minimum(pl.cdiv(length, page), first + per_split)

    def body(j, carry):
        col = first + j * ppb
        held = col + jnp.arange(ppb) < end
        pages = jnp.where(held, kt_ref[pl.ds(col, ppb)], 0)
        v_pages = jnp.where(held, vt_ref[pl.ds(col, ppb)], 0)
        token = col * page + jnp.arange(ppb * page)
        key, half = _rebuild_keys(kc_ref, ks_ref, kz_ref, kb_ref, kr_ref, km_ref, kmr_ref,
                                  pages, k_bits, wk, basis_dtype)
        angle = (first_position + token).astype(jnp.float32)[:, None] * inv_ref[...]
        key = key * jnp.cos(angle) + half * jnp.sin(angle)
        logits = dot_t(q, key.astype(q.dtype))
        v_loaded: dict = {}

        def values(i):
            c = coefficients(vc_ref, vs_ref, vz_ref, v_pages, v_bits, i, wv, v_loaded)
            return c.astype(basis_dtype)
        return online_update(carry, logits, (token < length)[None, :], values)

    carry = (tuple(jnp.zeros((rows, wv), jnp.float32) for _ in range(nv)),
             jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32))
    o_parts, m, denom = lax.fori_loop(0, pl.cdiv(jnp.maximum(end - first, 0), ppb), body,
                                      carry)
    o = denom[:, None] * vm_ref[...]
    for i in range(nv):
        o += _dot(o_parts[i].astype(basis_dtype),
                  vb_ref[pl.ds(i * wv, wv), :].astype(basis_dtype))
    o_ref[...] = o
    l_ref[...] = denom
    m_ref[...] = m


def rotate_half_columns(x: jax.Array, head_dim: int) -> jax.Array:
    """rotate_half of every head's D columns of x [..., H * D]: (a, b) -> (-b, a)."""
    heads = x.reshape(*x.shape[:-1], -1, 2, head_dim // 2)
    return jnp.stack([-heads[..., 1, :], heads[..., 0, :]], axis=-2).reshape(x.shape)


def _check(q, k: CoefficientPages, v: CoefficientPages, bases: LayerBases, k_table, v_table,
           lengths, first_position, inv_freq, pages_per_block: int, k_splits: int,
           interpret: bool) -> None:
    b, _, hq, d = q.shape
    f = bases.k_basis.shape[-1]
    if f % d or hq % (f // d):
        raise ValueError(f"bases of {f} features do not hold KV heads of head_dim {d} for "
                         f"{hq} query heads")
    for name, x, want in [("k_table", k_table, (b, k_table.shape[-1])),
                          ("v_table", v_table, k_table.shape),
                          ("lengths", lengths, (b,)), ("first_position", first_position, (b,)),
                          ("inv_freq", inv_freq, (d // 2,)),
                          ("k_basis", bases.k_basis, (b, k.width, f)),
                          ("v_basis", bases.v_basis, (b, v.width, f)),
                          ("k_mean", bases.k_mean, (b, f)), ("v_mean", bases.v_mean, (b, f))]:
        if x.shape != want:
            raise ValueError(f"{name} must be {list(want)}, got {list(x.shape)}")
    if k_splits < 1 or k_table.shape[1] % (pages_per_block * k_splits):
        raise ValueError(f"page-table width {k_table.shape[1]} is not a multiple of "
                         f"pages_per_block * k_splits = {pages_per_block} * {k_splits}")
    if k.page_size != v.page_size:
        raise ValueError(f"key and value pages differ in size: {k.page_size}, {v.page_size}")
    narrow = min(part_width(k.width, k.bits), part_width(v.width, v.bits), d)
    if not interpret and min(narrow, pages_per_block * k.page_size) < MIN_DOT:
        raise ValueError(f"rank parts and blocks must be >= {MIN_DOT} wide on a GPU")


def _operands(q, k: CoefficientPages, v: CoefficientPages, bases: LayerBases, k_table, v_table,
              lengths, first_position, inv_freq, rows: int) -> tuple[list, list]:
    """The kernel's operands in the order it takes them, and their BlockSpecs on the grid
    (sequence, KV head, split): q grouped by KV head (rows padded), the pools whole, the sequence's
    table rows, its length and first position, the inverse frequencies, and the KV head's
    columns of the bases (the key basis also as its rotate-half) and means."""
    b, c, hq, d = q.shape
    hkv = bases.k_basis.shape[-1] // d
    qg = jnp.moveaxis(q.reshape(b, c, hkv, hq // hkv, d), 1, 2).reshape(b, hkv, -1, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - qg.shape[2]), (0, 0)))
    inv = jnp.concatenate([inv_freq, inv_freq]).astype(jnp.float32)[None]
    lens = jnp.stack([lengths, first_position], axis=-1).astype(jnp.int32)
    k_rot, k_mean = (rotate_half_columns(x, d) for x in (bases.k_basis, bases.k_mean))
    means = [x.astype(jnp.float32)[:, None] for x in (bases.k_mean, k_mean, bases.v_mean)]
    operands = [qg, k.codes, k.scale, k.zero, v.codes, v.scale, v.zero,
                k_table.astype(jnp.int32), v_table.astype(jnp.int32), lens, inv,
                bases.k_basis, k_rot, means[0], means[1], bases.v_basis, means[2]]
    per_head = lambda x: pl.BlockSpec((None, x.shape[1], d), lambda i, h, s: (i, 0, h))  # noqa: E731
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    specs = ([pl.BlockSpec((None, None, rows, d), lambda i, h, s: (i, h, 0, 0))]
             + [full(x) for x in operands[1:7]]
             + [pl.BlockSpec((None, k_table.shape[1]), lambda i, h, s: (i, 0))] * 2
             + [pl.BlockSpec((None, 2), lambda i, h, s: (i, 0)), full(inv)]
             + [per_head(x) for x in operands[11:]])
    return operands, specs


@functools.partial(jax.jit, static_argnames=("sm_scale", "pages_per_block", "rank_block",
                                             "k_splits", "num_warps", "num_stages",
                                             "return_softmax_state", "interpret"))
def shared_pages_attention(
    q: jax.Array,  # [B, C, Hq, D]: already rotated to their positions
    k: CoefficientPages,  # the key coefficient pool [P, page, ...]
    v: CoefficientPages,  # the value coefficient pool
    bases: LayerBases,  # this layer's bases, per sequence
    k_table: jax.Array,  # int32 [B, W]: the history's key pages (its group's, aliased)
    v_table: jax.Array,  # int32 [B, W]: its value pages (the value group's)
    lengths: jax.Array,  # int32 [B]: history tokens
    first_position: jax.Array,  # int32 [B]: the position of the history's first token
    inv_freq: jax.Array,  # float32 [D / 2]: the rotary inverse frequencies
    *,
    sm_scale: float | None = None,
    pages_per_block: int = 1,
    rank_block: int = 64,
    k_splits: int = 1,
    num_warps: int = 4,
    num_stages: int = 2,
    return_softmax_state: bool = False,
    interpret: bool = False,
):
    """softmax(q K^T * sm_scale) V over the history the coefficient pages hold, K and V this
    layer's (`bases`), keys rotated to first_position + t: [B, C, Hq, D] in q's dtype, or
    with `return_softmax_state` (o [B, C, Hq, D] float32, denominator, row max [B, C, Hq]).
    The rank is walked `rank_block` columns at a time (a power of two, at least 16 on a GPU),
    so a large rank does not make one program's tiles large; a long history is cut into
    `k_splits` partitions of the table, merged by log-sum-exp after the kernel."""
    _check(q, k, v, bases, k_table, v_table, lengths, first_position, inv_freq,
           pages_per_block, k_splits, interpret)
    if rank_block & (rank_block - 1) or not interpret and rank_block < MIN_DOT:
        raise ValueError(f"rank_block must be a power of two >= {MIN_DOT}, got {rank_block}")
    b, c, hq, d = q.shape
    hkv = bases.k_basis.shape[-1] // d
    g = hq // hkv
    rows = max(MIN_DOT, pl.next_power_of_2(c * g))
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    operands, specs = _operands(q, k, v, bases, k_table, v_table, lengths, first_position,
                                inv_freq, rows)
    state = lambda *s: pl.BlockSpec((None, None, None) + s,  # noqa: E731
                                    lambda i, h, j: (i, h, j) + (0,) * len(s))
    o, denom, m = pl.pallas_call(
        functools.partial(_kernel, k_bits=k.bits, v_bits=v.bits,
                          pages_per_block=pages_per_block, rank_block=rank_block,
                          sm_scale=sm_scale),
        grid=(b, hkv, k_splits),
        in_specs=specs,
        out_specs=[state(rows, d), state(rows), state(rows)],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, k_splits, rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, k_splits, rows), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, k_splits, rows), jnp.float32)],
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"jkv_shared_pages_k{k.bits}v{v.bits}",
    )(*operands)
    o, denom, m = merge_softmax_states(o, denom, m, axis=2)
    o, denom, m = (jnp.moveaxis(x[:, :, :c * g].reshape(b, hkv, c, g, *x.shape[3:]), 2, 1)
                   .reshape(b, c, hq, *x.shape[3:]) for x in (o, denom, m))
    if return_softmax_state:
        return o, denom, m
    return normalize_softmax_state(o, denom).astype(q.dtype)


def dense_history(k: CoefficientPages, v: CoefficientPages, bases: LayerBases,
                  k_pages: jax.Array, v_pages: jax.Array, first_position: int,
                  inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One sequence's history rebuilt in plain jnp from its pages [n] (oracle): keys rotated
    to their positions and values, float32 [n * page, H, D] each (bases of batch 1)."""
    def side(pool: CoefficientPages, pages, basis, mean):
        codes = pool.codes[pages]
        codes = (codes.astype(jnp.float32) if pool.bits == 16
                 else unpack(codes, pool.bits).astype(jnp.float32))
        coef = codes * pool.scale[pages][:, None].astype(jnp.float32) \
            + pool.zero[pages][:, None].astype(jnp.float32)
        coef = coef.reshape(-1, pool.width)
        return jnp.dot(coef, basis[0].astype(jnp.float32),
                       precision=lax.Precision.HIGHEST) + mean[0]
    d = inv_freq.shape[0] * 2
    keys = side(k, k_pages, bases.k_basis, bases.k_mean)
    values = side(v, v_pages, bases.v_basis, bases.v_mean)
    t = keys.shape[0]
    angle = (first_position + jnp.arange(t, dtype=jnp.float32))[:, None] * inv_freq
    cos, sin = (f(jnp.concatenate([angle, angle], -1))[:, None] for f in (jnp.cos, jnp.sin))
    keys = keys.reshape(t, -1, d)
    rotated = jnp.concatenate([-keys[..., d // 2:], keys[..., :d // 2]], -1)
    return keys * cos + rotated * sin, values.reshape(t, -1, d)


def shared_pages_attention_reference(q: jax.Array, k: CoefficientPages, v: CoefficientPages,
                                     bases: LayerBases, k_table: jax.Array,
                                     v_table: jax.Array, lengths: jax.Array,
                                     first_position: jax.Array, inv_freq: jax.Array, *,
                                     sm_scale: float | None = None) -> jax.Array:
    """The same function in plain jnp, a sequence at a time: the history's keys and values
    rebuilt token by token (`dense_history`), one softmax per query row. [B, C, Hq, D]."""
    b, c, hq, d = q.shape
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    out = []
    for i in range(b):
        n = int(lengths[i])
        one = jax.tree.map(lambda x, i=i: x[i:i + 1], bases)
        held = -(-n // k.page_size)
        keys, values = dense_history(k, v, one, k_table[i, :held], v_table[i, :held],
                                     int(first_position[i]), inv_freq)
        keys, values = keys[:n], values[:n]  # [n, Hkv, D]
        g = hq // keys.shape[1]
        qi = q[i].astype(jnp.float32).reshape(c, keys.shape[1], g, d)
        s = jnp.einsum("chgd,thd->chgt", qi, keys, precision=lax.Precision.HIGHEST) * sm_scale
        p = jax.nn.softmax(s, axis=-1)
        out.append(jnp.einsum("chgt,thd->chgd", p, values,
                              precision=lax.Precision.HIGHEST).reshape(c, hq, d))
    return jnp.stack(out).astype(q.dtype)


__all__ = ["dense_history", "rotate_half_columns", "shared_pages_attention",
           "shared_pages_attention_reference"]
