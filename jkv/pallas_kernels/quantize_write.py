"""Quantize-and-write (Pallas, Triton lowering): whole pages of new K/V into the page pool.

One program per page: it reads the page in model dtype, computes the key scale and zero point
per channel over the page's tokens (or per (token, group) with `token_keys`) and the value
ones per (token, group of channels) exactly as `kv_quant` does, packs the codes part by part
(see `kv_quant` for the layout) and stores them, with the scales, at the page's id in the
pool. The pool arrays are aliased to the outputs, so inside a jit that donates them the write
is in place and pages not listed are untouched. Id 0 is the null page: writes may land there
(its content is garbage by contract).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jkv.kv.pages import KVPages
from jkv.kv.quant import codes_per_byte, group_range, quantize_codes


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
        codes, scale, zero = quantize_codes(x, lo, hi, bits, in_kernel=True)
        packed = packed | (codes << (bits * i)) if parts > 1 else codes
        scale_ref[pid, pl.ds(i * dp, dp)] = scale.reshape(dp)
        zero_ref[pid, pl.ds(i * dp, dp)] = zero.reshape(dp)
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
        lo, hi = group_range(g, bits, in_kernel=True)  # [page, n, 1]
        x = src_ref[:, pl.ds(i * dp, dp)].astype(jnp.float32).reshape(page, n, width)
        codes, scale, zero = quantize_codes(x, lo, hi, bits, in_kernel=True)
        codes = codes.reshape(page, dp)
        packed = packed | (codes << (bits * i)) if parts > 1 else codes
        scale_ref[pid, :, pl.ds(first_group, n)] = scale.reshape(page, n)
        zero_ref[pid, :, pl.ds(first_group, n)] = zero.reshape(page, n)
    out_ref[pid] = packed


def _kernel(*refs, kv_format, group: int):
    refs = list(refs)
    k_src_ref, v_src_ref, ids_ref = refs[:3]  # [page, D], [page, D], [N]
    n_in = (len(refs) - 3) // 2
    out = KVPages.from_operands(kv_format, refs[3 + n_in:])  # the aliased pool arrays
    pid = ids_ref[pl.program_id(0)]
    if kv_format.token_keys:  # keys scaled per (token, group) like values
        _write_values(k_src_ref, pid, out.k, out.k_scale, out.k_zero, kv_format.k_bits, group)
    else:
        _write_keys(k_src_ref, pid, out.k, out.k_scale, out.k_zero, kv_format.k_bits)
    _write_values(v_src_ref, pid, out.v, out.v_scale, out.v_zero, kv_format.v_bits, group)


def _check(k_src, v_src, page_ids, pages: KVPages) -> None:
    """Shapes and dtypes the kernel relies on: a mismatch would otherwise write out of place
    or fail deep inside the lowering."""
    if k_src.ndim != 3 or k_src.shape != v_src.shape:
        raise ValueError(f"k_src and v_src must both be [N, page, D], got {k_src.shape} and "
                         f"{v_src.shape}")
    n, page, d = k_src.shape
    if page_ids.shape != (n,) or not jnp.issubdtype(page_ids.dtype, jnp.integer):
        raise ValueError(f"page_ids must be integer [N={n}], got {page_ids.dtype} "
                         f"{page_ids.shape}")
    pages.check(d)
    if pages.page_size != page:
        raise ValueError(f"the pool's pages hold {pages.page_size} tokens, k_src's {page}")


@functools.partial(jax.jit, static_argnames=("num_warps", "interpret"))
def quantize_write(
    k_src: jax.Array,  # [N, page, D] model dtype: whole pages of keys
    v_src: jax.Array,  # [N, page, D]
    page_ids: jax.Array,  # int32 [N]: destination pages (0: the null page)
    pages: KVPages,  # the pool [P, page, ...]
    *,
    num_warps: int = 4,
    interpret: bool = False,
) -> KVPages:
    """Quantize pages into `pages`' format and store them at `page_ids`; returns the pool.
    Non-zero ids must be distinct; id 0 (padding) may repeat.

    The pool operands are aliased to the outputs, so inside a jit that donates the pool the
    write is in place (no copy of the pool); called on its own, XLA copies the pool first.
    """
    _check(k_src, v_src, page_ids, pages)
    fmt = pages.kv_format
    n, page, d = k_src.shape
    pool = pages.operands()
    full = lambda x: pl.BlockSpec(x.shape, lambda i: (0,) * x.ndim)  # noqa: E731
    src_spec = pl.BlockSpec((None, page, d), lambda i: (i, 0, 0))
    outs = pl.pallas_call(
        functools.partial(_kernel, kv_format=fmt, group=pages.group),
        grid=(n,),
        in_specs=[src_spec, src_spec, full(page_ids)] + [full(x) for x in pool],
        out_specs=[full(x) for x in pool],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pool],
        input_output_aliases={3 + i: i for i in range(len(pool))},
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"jkv_quantize_write_{fmt.name}",
    )(k_src, v_src, page_ids.astype(jnp.int32), *pool)
    return KVPages.from_operands(fmt, list(outs))


def quantize_write_reference(k_src: jax.Array, v_src: jax.Array, page_ids: jax.Array,
                             pages: KVPages) -> KVPages:
    """The same in plain jnp: `kv_quant` quantization, then a scatter to `page_ids`."""
    _check(k_src, v_src, page_ids, pages)
    return pages.put(page_ids, KVPages.from_dense(k_src, v_src, pages.kv_format, pages.dtype))
