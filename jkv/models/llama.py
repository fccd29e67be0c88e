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

The forward reads and writes KV through the page pool (`jkv.cache`), nothing else about
requests or pages.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jkv.cache.attention import paged_attention
from jkv.cache.page_pool import write_kv
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
           lp: Params, k_pool: jax.Array, v_pool: jax.Array, pages: jax.Array,
           positions: jax.Array, valid: jax.Array):
    b, t, _ = x.shape
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
    if cfg.qkv_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = apply_rope(q.reshape(b, t, cfg.num_heads, cfg.head_dim), positions, inv_freq)
    k = apply_rope(k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim), positions, inv_freq)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    k_pool, v_pool = write_kv(k_pool, v_pool, pages, k, v, positions, valid)
    attn = paged_attention(q, k_pool, v_pool, pages, positions, 1.0 / math.sqrt(cfg.head_dim),
                           backend=attention_backend)
    x = x + attn.reshape(b, t, -1) @ lp["wo"]
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    x = x + mlp(h, lp["w_gate"], lp["w_up"], lp["w_down"])
    return x, k_pool, v_pool


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            valid: jax.Array, k_pool: jax.Array, v_pool: jax.Array, page_table: jax.Array,
            attention_backend: str = "xla") -> tuple[jax.Array, jax.Array, jax.Array]:
    """Run tokens [B, T] at `positions` [B, T] through every layer over a paged KV cache.

    `page_table` [B, L, Hkv, W] must already cover every valid position (see
    `jkv.cache.reserve`); tokens with `valid` False are padding and write nothing that is
    read. Returns (final-normed hidden states [B, T, D], k_pool, v_pool).
    jit with `cfg` and `attention_backend` static.
    """
    inv_freq = jnp.asarray(inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    x = params["embed"][tokens]
    tables = jnp.moveaxis(page_table, 1, 0)  # [L, B, Hkv, W]

    def body(carry, xs):
        x, k_pool, v_pool = carry
        lp, pages = xs
        x, k_pool, v_pool = _layer(cfg, inv_freq, attention_backend, x, lp, k_pool, v_pool,
                                   pages, positions, valid)
        return (x, k_pool, v_pool), None

    (x, k_pool, v_pool), _ = jax.lax.scan(body, (x, k_pool, v_pool), (params["layers"], tables))
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), k_pool, v_pool


def lm_head(params: Params, hidden: jax.Array) -> jax.Array:
    """Hidden states [..., D] -> float32 logits [..., V] (tied or untied head)."""
    w = params["lm_head"] if "lm_head" in params else params["embed"].T
    return (hidden @ w).astype(jnp.float32)
