"""Saved pages moved to other token positions: what reusing a truncated conversation's KV
takes (CachedAttention 3.4).

When the oldest turns of a conversation are dropped, the tokens kept after them move to
earlier positions. Their stored KV stays valid once each key is rotated by its shift (RoPE
rotations compose: rotating a key at position p by d gives the key at p + d), and the tokens
are re-packed into whole pages at their new places. Quantized sides are dequantized,
re-rotated and quantized again over their new pages (the page scales change with the page's
tokens); a rotated format's keys leave its stored basis for that (`jkv.kv.rotation`).
One jitted function on the device; the rotation is the model's (`rotate` argument), so this
module knows nothing about RoPE variants.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp

from jkv.kv.pages import KVPages
from jkv.kv.rotation import rotate as basis_rotate


@partial(jax.jit, static_argnames="rotate")
def rebase_pages(pages: KVPages, src: jax.Array, shift: jax.Array, *,
                 rotate: Callable) -> KVPages:
    """Pages for new token positions: new token t (of `src.shape[0]`, whole pages) is saved
    token `src[t]` (an index into the saved pages [B, L, H, page, ...]'s tokens, in order)
    with its key rotated by `shift[t]` positions. `rotate(keys [L, T, H, D], shift [L, T])`
    is the model's rotation. Returns pages [T // page, L, H, page, ...] in the same format."""
    k, v = pages.dense()
    b, layers, heads, page, d = k.shape
    n = src.shape[0] // page

    def tokens(x):  # [B, L, H, page, D] -> [L, B * page, H, D] -> the new tokens
        x = jnp.moveaxis(x, 0, 2).reshape(layers, heads, b * page, d)
        return jnp.take(jnp.swapaxes(x, 1, 2), src, axis=1)

    shift = jnp.broadcast_to(shift, (layers, src.shape[0]))
    if pages.kv_format.rotated:  # RoPE turns keys in the model's basis, not the stored one
        k = basis_rotate(rotate(basis_rotate(tokens(k)), shift))
    else:
        k = rotate(tokens(k), shift)
    v = tokens(v)

    def paged(x):  # [L, T, H, D] -> [T // page, L, H, page, D]
        x = jnp.swapaxes(x, 1, 2).reshape(layers, heads, n, page, d)
        return jnp.moveaxis(x, 2, 0)

    return KVPages.from_dense(paged(k), paged(v), pages.kv_format, pages.dtype)
