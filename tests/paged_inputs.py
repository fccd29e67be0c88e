"""Inputs for the attention-over-pages tests: pools of shuffled pages in any format, with
everything a kernel must not read poisoned, shared by the chunked-prefill kernel's tests and
the xla backend's."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from jkv.kv.format import KVFormat
from jkv.kv.pages import KVPages


def paged_attention_inputs(rng, plen, start, wlen, pos, *, t: int, gqa: int, d: int,
                           k_bits: int, v_bits: int, width: int, page: int, group: int,
                           poison: float, dtype=jnp.float32, token_keys: bool = False) -> tuple:
    """The arguments of `chunked_prefill_attention` for rows holding `plen` [B, Hkv] page
    tokens, windows of `wlen` [B] tokens from `start` [B] and queries at `pos` [B, t]; the
    pages are in format (k_bits, v_bits, group, token_keys).

    Pages are shuffled across the pool; the null page, page tokens past a row's length,
    table columns past its pages (pointed at the null page) and window tokens past its
    length hold +-`poison`, so a missing mask shows as a huge error.
    """
    b, hkv = plen.shape
    tw = page + -(-t // page) * page
    num_pages = b * hkv * width + 1
    k = rng.normal(size=(num_pages, page, d)) * (1 + 4 * (rng.random(d) < 0.1))  # outliers
    v = rng.normal(size=(num_pages, page, d))
    table = (1 + rng.permutation(num_pages - 1)).reshape(b, hkv, width)
    k[0], v[0] = poison, -poison  # the null page
    for i in range(b):
        for h in range(hkv):
            n = plen[i, h]
            for c in range(width):  # tokens past the prefix in its pages
                lo = max(n - c * page, 0)
                k[table[i, h, c], lo:] = poison
                v[table[i, h, c], lo:] = -poison
            table[i, h, -(-n // page):] = 0  # unused columns point at the null page
    kw = rng.normal(size=(b, hkv, tw, d))
    vw = rng.normal(size=(b, hkv, tw, d))
    for i in range(b):
        kw[i, :, wlen[i]:], vw[i, :, wlen[i]:] = poison, -poison
    pages = KVPages.from_dense(jnp.asarray(k, dtype), jnp.asarray(v, dtype),
                               KVFormat(k_bits, v_bits, group, token_keys))
    q = jnp.asarray(rng.normal(size=(b, t, hkv * gqa, d)), dtype)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return (q, pages, i32(table), i32(plen), jnp.asarray(kw, dtype), jnp.asarray(vw, dtype),
            i32(start), i32(wlen), i32(pos))
