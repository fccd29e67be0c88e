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

from jkv.pallas_kernels.kv_pages import NULL_PAGE, KVPages
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
