"""Attention over paged KV: the pure-jnp (`xla`) backend.

Queries of any count (a prefill chunk or one decode token) attend, causally by absolute
position, to everything the sequence's pages hold. Grouped-query attention: the query heads
of one KV head read that head's pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ATTENTION_BACKENDS = ("xla",)


def gather_pages(pool: jax.Array, pages: jax.Array) -> jax.Array:
    """Pool [P, page, D] read through a page table [B, H, W] -> [B, H, W * page, D]."""
    b, h, w = pages.shape
    _, page_size, d = pool.shape
    return pool[pages].reshape(b, h, w * page_size, d)


def paged_attention_xla(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, pages: jax.Array,
                        q_positions: jax.Array, sm_scale: float) -> jax.Array:
    """softmax(q k^T * sm_scale) v for q [B, T, Hq, D] against one layer's pages [B, Hkv, W].

    Key j of a row sits at absolute position j (pages are in position order); query t sees
    keys at positions <= q_positions[b, t]. Returns [B, T, Hq, D] in q's dtype.
    """
    b, t, hq, d = q.shape
    hkv = pages.shape[1]
    k = gather_pages(k_pool, pages).astype(jnp.float32)  # [B, Hkv, S, D]
    v = gather_pages(v_pool, pages).astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, d)
    scores = jnp.einsum("bthgd,bhsd->bhgts", qg, k) * sm_scale
    key_pos = jnp.arange(k.shape[2], dtype=jnp.int32)
    visible = key_pos[None, None, :] <= q_positions[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgts,bhsd->bthgd", probs, v)
    return out.reshape(b, t, hq, d).astype(q.dtype)


def paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, pages: jax.Array,
                    q_positions: jax.Array, sm_scale: float, backend: str = "xla") -> jax.Array:
    """Dispatch to an attention backend (see `ATTENTION_BACKENDS`)."""
    if backend == "xla":
        return paged_attention_xla(q, k_pool, v_pool, pages, q_positions, sm_scale)
    raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
