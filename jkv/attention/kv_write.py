"""Appending a step's new K/V to each sequence: whole pages go into the pool in its format,
the page still being filled stays in model dtype (`FillingPages`).

The step's tokens together with the filling page form a full-precision *window* that the
step's attention reads beside the pool (`jkv.attention.backend`), so a prefill chunk attends to
its own tokens unquantized and a page is quantized exactly once, as a unit, when it is full.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jkv.kv.pages import NULL_PAGE, KVPages
from jkv.pallas_kernels.quantize_write import quantize_write


class Window(NamedTuple):
    """The full-precision tail of each row: token i sits at position `start + i`."""

    k: jax.Array  # [B, Hkv, Tw, D] model dtype
    v: jax.Array  # [B, Hkv, Tw, D]
    start: jax.Array  # int32 [B]: tokens held in full pages before the step
    length: jax.Array  # int32 [B]: valid window tokens


def write_pages(pool: KVPages, k_src: jax.Array, v_src: jax.Array, page_ids: jax.Array,
                backend: str) -> KVPages:
    """Store whole pages k_src, v_src [N, page, D] at `page_ids` [N] (0: dropped)."""
    if backend == "pallas":
        return quantize_write(k_src, v_src, page_ids, pool,
                              interpret=jax.default_backend() == "cpu")
    # xla: `kv_quant`'s codes scattered to the ids; ids 0 (pages not full) are dropped, so
    # the pool's other pages (the null page included) are left as they were
    return pool.put(page_ids, KVPages.from_dense(k_src, v_src, pool.kv_format, pool.dtype))


def step_window(filling_k: jax.Array, filling_v: jax.Array, k_new: jax.Array,
                v_new: jax.Array, start: jax.Array, count: jax.Array
                ) -> tuple[Window, jax.Array, jax.Array]:
    """The step's window (the filling page's tokens, then `count` [B] new ones k_new, v_new
    [B, T, Hkv, D] at positions start + t) and the new filling pages: the window's last,
    partly filled page. Window pages before it are full: they leave the window."""
    page = filling_k.shape[2]
    b, t, h, d = k_new.shape
    tw = page + -(-t // page) * page
    start, count = start.astype(jnp.int32), count.astype(jnp.int32)
    r = start % page
    i = jnp.arange(tw, dtype=jnp.int32)
    src = jnp.clip(i[None, :] - r[:, None], 0, t - 1)[:, None, :, None]  # [B, 1, Tw, 1]
    from_filling = (i[None, :] < r[:, None])[:, None, :, None]

    def window_of(filling: jax.Array, new: jax.Array) -> jax.Array:
        new = jnp.take_along_axis(jnp.swapaxes(new, 1, 2).astype(filling.dtype), src, axis=2)
        filling = jnp.pad(filling, ((0, 0), (0, 0), (0, tw - page), (0, 0)))
        return jnp.where(from_filling, filling, new)  # [B, Hkv, Tw, D]

    window = Window(window_of(filling_k, k_new), window_of(filling_v, v_new), start - r,
                    r + count)
    return window, last_page(window.k, window.length, page), last_page(window.v, window.length,
                                                                       page)


def last_page(x: jax.Array, length: jax.Array, page: int) -> jax.Array:
    """The page of a window's values x [B, Hkv, Tw, ...] that its token `length` [B] falls
    in: [B, Hkv, page, ...] (the filling page after the step)."""
    b, h, tw = x.shape[:3]
    nw = tw // page
    keep = jnp.clip(length // page, 0, nw - 1).reshape(b, 1, 1, 1, *([1] * (x.ndim - 3)))
    pages = x.reshape(b, h, nw, page, *x.shape[3:])
    return jnp.take_along_axis(pages, keep, axis=2)[:, :, 0]


def append_kv(pool: KVPages, filling_k: jax.Array, filling_v: jax.Array, pages: jax.Array,
              k_new: jax.Array, v_new: jax.Array, start: jax.Array, count: jax.Array,
              backend: str = "xla") -> tuple[KVPages, jax.Array, jax.Array, Window]:
    """Append `count` [B] new tokens k_new, v_new [B, T, Hkv, D] at positions start + t.

    `start` [B] is each sequence's length before the step and `pages` [B, Hkv, W] its page
    table, already reserved up to start + count; filling_k/v [B, Hkv, page, D] hold tokens
    [page * (start // page), start). Tokens t >= count are padding and are not kept.
    Returns the pool with every page completed by this step written in its format, the new
    filling pages, and the step's full-precision window.
    """
    page = pool.page_size
    window, fill_k, fill_v = step_window(filling_k, filling_v, k_new, v_new, start, count)
    b, h, tw, d = window.k.shape
    nw = tw // page
    full = (jnp.arange(nw) + 1)[None, :] * page <= window.length[:, None]  # [B, nw]
    col = jnp.clip(window.start[:, None] // page + jnp.arange(nw)[None, :], 0,
                   pages.shape[-1] - 1)
    ids = jnp.take_along_axis(pages, jnp.broadcast_to(col[:, None, :], (b, h, nw)), axis=2)
    ids = jnp.where(full[:, None, :], ids, NULL_PAGE)
    pool = write_pages(pool, window.k.reshape(b * h * nw, page, d),
                       window.v.reshape(b * h * nw, page, d), ids.reshape(-1), backend)
    return pool, fill_k, fill_v, window
