"""Quantize-and-write (Pallas, Triton lowering): whole pages of new K/V into the page pool.

One program per page: it reads the page in model dtype, computes the key scale and zero point
per channel over the page's tokens and the value ones per (token, group of channels) exactly
as `kv_quant` does, packs the codes part by part (see `kv_quant` for the layout) and stores
them, with the scales, at the page's id in the pool. The pool arrays are aliased to the
outputs, so inside a jit that donates them the write is in place and pages not listed are
untouched. Id 0 is the null page: writes may land there (its content is garbage by contract).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jkv.pallas_kernels.kv_quant import (
    codes_per_byte,
    quantize_codes,
    quantize_keys,
    quantize_values,
)


def _write_keys(src_ref, pid, out_ref, scale_ref, zero_ref, bits: int) -> None:
    page, d = src_ref.shape
    if bits == 16:
        out_ref[pid] = src_ref[...].astype(out_ref.dtype)
        return
    parts = codes_per_byte(bits)
    dp = d // parts
    packed = jnp.zeros((page, dp), jnp.uint8)
    for i in range(parts):
        x = src_ref[:, pl.ds(i * dp, dp)].astype(jnp.float32)  # [page, dp]
        lo, hi = x.min(axis=0, keepdims=True), x.max(axis=0, keepdims=True)  # per channel
        codes, scale = quantize_codes(x, lo, hi, bits)
        packed = packed | (codes << (bits * i)) if parts > 1 else codes
        scale_ref[pid, pl.ds(i * dp, dp)] = scale.reshape(dp)
        zero_ref[pid, pl.ds(i * dp, dp)] = lo.reshape(dp)
    out_ref[pid] = packed


def _write_values(src_ref, pid, out_ref, scale_ref, zero_ref, bits: int, group: int) -> None:
    page, d = src_ref.shape
    if bits == 16:
        out_ref[pid] = src_ref[...].astype(out_ref.dtype)
        return
    parts = codes_per_byte(bits)
    dp = d // parts
    width = min(group, dp)  # channels of one group inside a part
    n = dp // width  # groups a part touches
    packed = jnp.zeros((page, dp), jnp.uint8)
    for i in range(parts):
        first_group = (i * dp) // group
        # whole groups (a group may span several parts): statistics per (token, group)
        g = src_ref[:, pl.ds(first_group * group, n * group)].astype(jnp.float32)
        g = g.reshape(page, n, group)
        lo, hi = g.min(axis=-1, keepdims=True), g.max(axis=-1, keepdims=True)  # [page, n, 1]
        x = src_ref[:, pl.ds(i * dp, dp)].astype(jnp.float32).reshape(page, n, width)
        codes, scale = quantize_codes(x, lo, hi, bits)
        codes = codes.reshape(page, dp)
        packed = packed | (codes << (bits * i)) if parts > 1 else codes
        scale_ref[pid, :, pl.ds(first_group, n)] = scale.reshape(page, n)
        zero_ref[pid, :, pl.ds(first_group, n)] = lo.reshape(page, n)
    out_ref[pid] = packed


def _kernel(*refs, k_bits: int, v_bits: int, group: int):
    refs = list(refs)
    k_src_ref, v_src_ref, ids_ref = refs[:3]  # [page, D], [page, D], [N]
    n_in = (len(refs) - 3) // 2
    outs = refs[3 + n_in:]  # the aliased pool arrays, in the input order
    k_out = outs.pop(0)  # [P, page, D // (8 // k_bits)] or [P, page, D]
    ks_out, kz_out = (outs.pop(0), outs.pop(0)) if k_bits < 16 else (None, None)  # [P, D]
    v_out = outs.pop(0)  # [P, page, D // (8 // v_bits)] or [P, page, D]
    vs_out, vz_out = (outs.pop(0), outs.pop(0)) if v_bits < 16 else (None, None)  # [P, page, G]
    pid = ids_ref[pl.program_id(0)]
    _write_keys(k_src_ref, pid, k_out, ks_out, kz_out, k_bits)
    _write_values(v_src_ref, pid, v_out, vs_out, vz_out, v_bits, group)


def _check(k_src, v_src, page_ids, k_pages, v_pages, k_scale, k_zero, v_scale, v_zero,
           k_bits, v_bits, group) -> None:
    """Shapes and dtypes the kernel relies on: a mismatch would otherwise write out of place
    or fail deep inside the lowering."""
    if k_src.ndim != 3 or k_src.shape != v_src.shape:
        raise ValueError(f"k_src and v_src must both be [N, page, D], got {k_src.shape} and "
                         f"{v_src.shape}")
    n, page, d = k_src.shape
    if page_ids.shape != (n,) or not jnp.issubdtype(page_ids.dtype, jnp.integer):
        raise ValueError(f"page_ids must be integer [N={n}], got {page_ids.dtype} "
                         f"{page_ids.shape}")
    if group < 1 or d % group:
        raise ValueError(f"group {group} does not divide head_dim {d}")
    num_pages = k_pages.shape[0]
    for side, bits, pages, scale, zero in (("k", k_bits, k_pages, k_scale, k_zero),
                                           ("v", v_bits, v_pages, v_scale, v_zero)):
        if bits not in (16, 8, 4, 2):
            raise ValueError(f"{side}_bits must be one of 16, 8, 4, 2, got {bits}")
        per = codes_per_byte(bits) if bits < 16 else 1
        if d % per:
            raise ValueError(f"head_dim {d} is not a multiple of {per} codes per byte at "
                             f"{side}_bits={bits}")
        if pages.shape != (num_pages, page, d // per):
            raise ValueError(f"{side}_pages {pages.shape} cannot hold {num_pages} pages of "
                             f"{page} tokens x {d} channels at {bits} bits")
        if bits < 16 and pages.dtype != jnp.uint8:
            raise ValueError(f"{side}_pages must be uint8 codes at {bits} bits, got {pages.dtype}")
        if (bits < 16) != (scale is not None and zero is not None):
            raise ValueError(f"{side}_scale and {side}_zero are required exactly when "
                             f"{side}_bits < 16")
        if bits < 16:
            want = (num_pages, d) if side == "k" else (num_pages, page, d // group)
            for name, x in ((f"{side}_scale", scale), (f"{side}_zero", zero)):
                if x.shape != want or x.dtype != jnp.float32:
                    raise ValueError(f"{name} must be float32 {want}, got {x.dtype} {x.shape}")
            dp = d // per
            if side == "v" and dp % group and group % dp:
                raise ValueError(f"value group {group} and the {dp} channels of one packed "
                                 f"part must divide one another")


@functools.partial(jax.jit, static_argnames=("k_bits", "v_bits", "group", "num_warps",
                                             "interpret"))
def quantize_write(
    k_src: jax.Array,  # [N, page, D] model dtype: whole pages of keys
    v_src: jax.Array,  # [N, page, D]
    page_ids: jax.Array,  # int32 [N]: destination pages (0: the null page)
    k_pages: jax.Array,  # [P, page, D // (8 // k_bits)] uint8, or [P, page, D] model dtype
    v_pages: jax.Array,  # [P, page, D // (8 // v_bits)] uint8, or [P, page, D] model dtype
    k_scale: jax.Array | None = None,  # f32 [P, D]
    k_zero: jax.Array | None = None,  # f32 [P, D]
    v_scale: jax.Array | None = None,  # f32 [P, page, D // group]
    v_zero: jax.Array | None = None,  # f32 [P, page, D // group]
    *,
    k_bits: int = 16,
    v_bits: int = 16,
    group: int = 64,
    num_warps: int = 4,
    interpret: bool = False,
) -> tuple:
    """Quantize pages and store them at `page_ids`; returns the six pool arrays (None stays
    None). Non-zero ids must be distinct; id 0 (padding) may repeat.

    The pool operands are aliased to the outputs, so inside a jit that donates the pool the
    write is in place (no copy of the pool); called on its own, XLA copies the pool first.
    """
    group = min(group, k_src.shape[-1])
    _check(k_src, v_src, page_ids, k_pages, v_pages, k_scale, k_zero, v_scale, v_zero,
           k_bits, v_bits, group)
    n, page, d = k_src.shape
    pool = [x for x in (k_pages, k_scale, k_zero, v_pages, v_scale, v_zero) if x is not None]
    full = lambda x: pl.BlockSpec(x.shape, lambda i: (0,) * x.ndim)  # noqa: E731
    src_spec = pl.BlockSpec((None, page, d), lambda i: (i, 0, 0))
    outs = pl.pallas_call(
        functools.partial(_kernel, k_bits=k_bits, v_bits=v_bits, group=group),
        grid=(n,),
        in_specs=[src_spec, src_spec, full(page_ids)] + [full(x) for x in pool],
        out_specs=[full(x) for x in pool],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pool],
        input_output_aliases={3 + i: i for i in range(len(pool))},
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"jkv_quantize_write_k{k_bits}v{v_bits}",
    )(k_src, v_src, page_ids.astype(jnp.int32), *pool)
    outs = list(outs)
    k_pages = outs.pop(0)
    k_scale, k_zero = (outs.pop(0), outs.pop(0)) if k_bits < 16 else (None, None)
    v_pages = outs.pop(0)
    v_scale, v_zero = (outs.pop(0), outs.pop(0)) if v_bits < 16 else (None, None)
    return k_pages, v_pages, k_scale, k_zero, v_scale, v_zero


def quantize_write_reference(k_src, v_src, page_ids, k_pages, v_pages, k_scale=None,
                             k_zero=None, v_scale=None, v_zero=None, *, k_bits=16, v_bits=16,
                             group=64) -> tuple:
    """The same in plain jnp: `kv_quant` quantization, then a scatter to `page_ids`."""
    group = min(group, k_src.shape[-1])
    _check(k_src, v_src, page_ids, k_pages, v_pages, k_scale, k_zero, v_scale, v_zero,
           k_bits, v_bits, group)
    if k_bits < 16:
        codes, scale, zero = quantize_keys(k_src, k_bits)
        k_pages = k_pages.at[page_ids].set(codes)
        k_scale, k_zero = k_scale.at[page_ids].set(scale), k_zero.at[page_ids].set(zero)
    else:
        k_pages = k_pages.at[page_ids].set(k_src.astype(k_pages.dtype))
    if v_bits < 16:
        codes, scale, zero = quantize_values(v_src, v_bits, group)
        v_pages = v_pages.at[page_ids].set(codes)
        v_scale, v_zero = v_scale.at[page_ids].set(scale), v_zero.at[page_ids].set(zero)
    else:
        v_pages = v_pages.at[page_ids].set(v_src.astype(v_pages.dtype))
    return k_pages, v_pages, k_scale, k_zero, v_scale, v_zero
