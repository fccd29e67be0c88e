"""The Llama family (Llama, Mistral, Qwen2, SmolLM2) as pure functions over a params pytree.

Params (per-layer weights stacked on a leading layer axis so the layers run as one scan):

    embed       [V, D]
    final_norm  [D]
    lm_head     [D, V]            absent when embeddings are tied
    layers:
      attn_norm [L, D]            mlp_norm [L, D]
      wq [L, D, Hq*Dh]  wk, wv [L, D, Hkv*Dh]  wo [L, Hq*Dh, D]
      bq [L, Hq*Dh]     bk, bv [L, Hkv*Dh]     (only with qkv_bias, Qwen2)
      w_gate, w_up [L, D, F]      w_down [L, F, D]

The forward reads and writes KV through the page pool (`jkv.cache`: append, attend), nothing
else about requests or pages.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jkv.cache.attention import paged_attention
from jkv.cache.kv_write import append_kv
from jkv.cache.page_pool import FillingPages, PagePool
from jkv.config import ModelConfig
from jkv.models.rope import apply_rope, inv_frequencies

Params = dict


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)


def mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU."""
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def _layer(cfg: ModelConfig, inv_freq: jax.Array, attention_backend: str, x: jax.Array,
           lp: Params, pool: PagePool, fill_k: jax.Array, fill_v: jax.Array, pages: jax.Array,
           positions: jax.Array, count: jax.Array):
    b, t, _ = x.shape
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
    if cfg.qkv_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = apply_rope(q.reshape(b, t, cfg.num_heads, cfg.head_dim), positions, inv_freq)
    k = apply_rope(k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim), positions, inv_freq)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    pool, fill_k, fill_v, window = append_kv(pool, fill_k, fill_v, pages, k, v, positions[:, 0],
                                             count, attention_backend)
    attn = paged_attention(q, pool, pages, window, positions, 1.0 / math.sqrt(cfg.head_dim),
                           backend=attention_backend)
    x = x + attn.reshape(b, t, -1) @ lp["wo"]
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    x = x + mlp(h, lp["w_gate"], lp["w_up"], lp["w_down"])
    return x, pool, fill_k, fill_v


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            valid: jax.Array, pool: PagePool, filling: FillingPages, page_table: jax.Array,
            attention_backend: str = "xla") -> tuple[jax.Array, PagePool, FillingPages]:
    """Run tokens [B, T] at `positions` [B, T] through every layer over a paged KV cache.

    Each row's valid tokens come first and continue its sequence: positions[b, t] =
    positions[b, 0] + t, positions[b, 0] being the tokens it already holds. `page_table`
    [B, L, Hkv, W] must already cover every valid position (see `jkv.cache.reserve`) and
    `filling` [B, L, ...] holds each row's partly filled pages. Padding tokens (`valid`
    False) are not kept. Returns (final-normed hidden states [B, T, D], pool, filling).
    jit with `cfg` and `attention_backend` static. The layers run as one scan; `layer` runs
    one of them, for callers that dispatch layer by layer.
    """
    x = params["embed"][tokens]
    per_layer = (jnp.arange(cfg.num_layers), jnp.moveaxis(page_table, 1, 0),
                 jnp.moveaxis(filling.k, 1, 0), jnp.moveaxis(filling.v, 1, 0))

    def body(carry, xs):
        x, pool = carry
        index, pages, fill_k, fill_v = xs
        x, pool, fill_k, fill_v = layer(params, cfg, index, x, pool, fill_k, fill_v, pages,
                                        positions, valid, attention_backend)
        return (x, pool), (fill_k, fill_v)

    (x, pool), (fill_k, fill_v) = jax.lax.scan(body, (x, pool), per_layer)
    filling = FillingPages(k=jnp.moveaxis(fill_k, 0, 1), v=jnp.moveaxis(fill_v, 0, 1))
    return final_norm(params, cfg, x), pool, filling


def layer(params: Params, cfg: ModelConfig, index: jax.Array, x: jax.Array, pool: PagePool,
          fill_k: jax.Array, fill_v: jax.Array, pages: jax.Array, positions: jax.Array,
          valid: jax.Array, attention_backend: str = "xla"):
    """Layer `index` (traced: one compiled function serves every layer) on hidden states
    x [B, T, D]; fill_k/v [B, Hkv, page, D] and pages [B, Hkv, W] are that layer's.
    Returns (x, pool, fill_k, fill_v)."""
    lp = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, index, keepdims=False),
                      params["layers"])
    inv_freq = jnp.asarray(inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    count = valid.sum(axis=1).astype(jnp.int32)
    return _layer(cfg, inv_freq, attention_backend, x, lp, pool, fill_k, fill_v, pages,
                  positions, count)


def final_norm(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


def lm_head(params: Params, hidden: jax.Array) -> jax.Array:
    """Hidden states [..., D] -> float32 logits [..., V] (tied or untied head)."""
    w = params["lm_head"] if "lm_head" in params else params["embed"].T
    return (hidden @ w).astype(jnp.float32)
