"""Saved pages moved to other token positions: what reusing a truncated conversation's KV
takes (CachedAttention 3.4).

When the oldest turns of a conversation are dropped, the tokens kept after them move to
earlier positions. Their stored KV stays valid once each key is rotated by its shift (RoPE
rotations compose: rotating a key at position p by d gives the key at p + d), and the tokens
are re-packed into whole pages at their new places. Quantized sides are dequantized,
re-rotated and quantized again over their new pages (the page scales change with the page's
tokens). One jitted function on the device; the rotation is the model's (`rotate` argument),
so this module knows nothing about RoPE variants.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp

from jkv.config import KVFormat
from jkv.pallas_kernels.kv_quant import (
    dequantize_keys,
    dequantize_values,
    quantize_keys,
    quantize_values,
)


def _dense(pages: dict[str, jax.Array], fmt: KVFormat) -> tuple[jax.Array, jax.Array]:
    """Keys and values of saved pages [B, L, H, page, ...] as float32 [B, L, H, page, D]."""
    k, v = pages["k"].astype(jnp.float32), pages["v"].astype(jnp.float32)
    if fmt.k_bits < 16:
        k = dequantize_keys(pages["k"], pages["k_scale"], pages["k_zero"], fmt.k_bits)
    if fmt.v_bits < 16:
        v = dequantize_values(pages["v"], pages["v_scale"], pages["v_zero"], fmt.v_bits)
    return k, v


def _pack(k: jax.Array, v: jax.Array, fmt: KVFormat, group: int, dtype) -> dict:
    out = {}
    if fmt.k_bits < 16:
        out["k"], out["k_scale"], out["k_zero"] = quantize_keys(k, fmt.k_bits)
    else:
        out["k"] = k.astype(dtype)
    if fmt.v_bits < 16:
        out["v"], out["v_scale"], out["v_zero"] = quantize_values(v, fmt.v_bits, group)
    else:
        out["v"] = v.astype(dtype)
    return out


@partial(jax.jit, static_argnames=("fmt", "group", "dtype", "rotate"))
def rebase_pages(pages: dict[str, jax.Array], src: jax.Array, shift: jax.Array, *,
                 fmt: KVFormat, group: int, dtype, rotate: Callable) -> dict[str, jax.Array]:
    """Pages for new token positions: new token t (of `src.shape[0]`, whole pages) is saved
    token `src[t]` (an index into the saved pages' tokens, in order) with its key rotated by
    `shift[t]` positions. `rotate(keys [L, T, H, D], shift [L, T])` is the model's rotation.
    Returns arrays [T // page, L, H, page, ...] in the same format as `pages`."""
    k, v = _dense(pages, fmt)
    b, layers, heads, page, d = k.shape
    n = src.shape[0] // page

    def tokens(x):  # [B, L, H, page, D] -> [L, B * page, H, D] -> the new tokens
        x = jnp.moveaxis(x, 0, 2).reshape(layers, heads, b * page, d)
        return jnp.take(jnp.swapaxes(x, 1, 2), src, axis=1)

    k = rotate(tokens(k), jnp.broadcast_to(shift, (layers, src.shape[0])))
    v = tokens(v)

    def paged(x):  # [L, T, H, D] -> [T // page, L, H, page, D]
        x = jnp.swapaxes(x, 1, 2).reshape(layers, heads, n, page, d)
        return jnp.moveaxis(x, 2, 0)

    return _pack(paged(k), paged(v), fmt, group, dtype)
