"""Appending a step's new K/V to each sequence: whole pages go into the pool in its format,
the page still being filled stays in model dtype (`FillingPages`).

The step's tokens together with the filling page form a full-precision *window* that the
step's attention reads beside the pool (`jkv.cache.attention`), so a prefill chunk attends to
its own tokens unquantized and a page is quantized exactly once, as a unit, when it is full.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jkv.cache.page_pool import NULL_PAGE, PagePool
from jkv.pallas_kernels.kv_quant import quantize_keys, quantize_values
from jkv.pallas_kernels.quantize_write import quantize_write


class Window(NamedTuple):
    """The full-precision tail of each row: token i sits at position `start + i`."""

    k: jax.Array  # [B, Hkv, Tw, D] model dtype
    v: jax.Array  # [B, Hkv, Tw, D]
    start: jax.Array  # int32 [B]: tokens held in full pages before the step
    length: jax.Array  # int32 [B]: valid window tokens


def write_pages(pool: PagePool, k_src: jax.Array, v_src: jax.Array, page_ids: jax.Array,
                backend: str) -> PagePool:
    """Store whole pages k_src, v_src [N, page, D] at `page_ids` [N] (0: dropped)."""
    fmt = pool.kv_format
    if backend == "pallas":
        out = quantize_write(k_src, v_src, page_ids, pool.k, pool.v, pool.k_scale, pool.k_zero,
                             pool.v_scale, pool.v_zero, k_bits=fmt.k_bits, v_bits=fmt.v_bits,
                             group=pool.group, interpret=jax.default_backend() == "cpu")
        k, v, k_scale, k_zero, v_scale, v_zero = out
        return pool.replace(k=k, v=v, k_scale=k_scale, k_zero=k_zero, v_scale=v_scale,
                            v_zero=v_zero)
    # xla: `kv_quant`'s codes scattered to the ids; ids 0 (pages not full) are dropped, so
    # the pool's other pages (the null page included) are left as they were
    ids = jnp.where(page_ids == NULL_PAGE, pool.k.shape[0], page_ids)
    put = lambda dst, x: dst.at[ids].set(x.astype(dst.dtype), mode="drop")  # noqa: E731
    out = {}
    if fmt.k_bits < 16:
        codes, scale, zero = quantize_keys(k_src, fmt.k_bits)
        out.update(k=put(pool.k, codes), k_scale=put(pool.k_scale, scale),
                   k_zero=put(pool.k_zero, zero))
    else:
        out["k"] = put(pool.k, k_src)
    if fmt.v_bits < 16:
        codes, scale, zero = quantize_values(v_src, fmt.v_bits, pool.group)
        out.update(v=put(pool.v, codes), v_scale=put(pool.v_scale, scale),
                   v_zero=put(pool.v_zero, zero))
    else:
        out["v"] = put(pool.v, v_src)
    return pool.replace(**out)


def append_kv(pool: PagePool, filling_k: jax.Array, filling_v: jax.Array, pages: jax.Array,
              k_new: jax.Array, v_new: jax.Array, start: jax.Array, count: jax.Array,
              backend: str = "xla") -> tuple[PagePool, jax.Array, jax.Array, Window]:
    """Append `count` [B] new tokens k_new, v_new [B, T, Hkv, D] at positions start + t.

    `start` [B] is each sequence's length before the step and `pages` [B, Hkv, W] its page
    table, already reserved up to start + count; filling_k/v [B, Hkv, page, D] hold tokens
    [page * (start // page), start). Tokens t >= count are padding and are not kept.
    Returns the pool with every page completed by this step written in its format, the new
    filling pages, and the step's full-precision window.
    """
    page = pool.page_size
    b, t, h, d = k_new.shape
    tw = page + -(-t // page) * page
    nw = tw // page
    start, count = start.astype(jnp.int32), count.astype(jnp.int32)
    r = start % page
    i = jnp.arange(tw, dtype=jnp.int32)
    src = jnp.clip(i[None, :] - r[:, None], 0, t - 1)[:, None, :, None]  # [B, 1, Tw, 1]
    from_filling = (i[None, :] < r[:, None])[:, None, :, None]

    def window_of(filling: jax.Array, new: jax.Array) -> jax.Array:
        new = jnp.take_along_axis(jnp.swapaxes(new, 1, 2).astype(filling.dtype), src, axis=2)
        filling = jnp.pad(filling, ((0, 0), (0, 0), (0, tw - page), (0, 0)))
        return jnp.where(from_filling, filling, new)  # [B, Hkv, Tw, D]

    window_k, window_v = window_of(filling_k, k_new), window_of(filling_v, v_new)
    length = r + count
    full = (jnp.arange(nw) + 1)[None, :] * page <= length[:, None]  # [B, nw]
    col = jnp.clip(start[:, None] // page + jnp.arange(nw)[None, :], 0, pages.shape[-1] - 1)
    ids = jnp.take_along_axis(pages, jnp.broadcast_to(col[:, None, :], (b, h, nw)), axis=2)
    ids = jnp.where(full[:, None, :], ids, NULL_PAGE)
    pool = write_pages(pool, window_k.reshape(b * h * nw, page, d),
                       window_v.reshape(b * h * nw, page, d), ids.reshape(-1), backend)

    keep = jnp.clip(length // page, 0, nw - 1)[:, None, None, None, None]

    def filling_of(window: jax.Array) -> jax.Array:
        return jnp.take_along_axis(window.reshape(b, h, nw, page, d), keep, axis=2)[:, :, 0]

    window = Window(window_k, window_v, start - r, length)
    return pool, filling_of(window_k), filling_of(window_v), window
