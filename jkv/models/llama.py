"""The Llama family (Llama, Mistral, Qwen2, SmolLM2) as pure functions over a params pytree.

Params (per-layer weights stacked on a leading layer axis so the layers run as one scan):

    embed       [V, D]
    final_norm  [D]
    lm_head     [D, V]            absent when embeddings are tied
    layers:
      attn_norm [L, D]            mlp_norm [L, D]
      wqkv [L, D, (Hq+2Hkv)*Dh]   wo [L, Hq*Dh, D]     (q, k, v projections side by side)
      bqkv [L, (Hq+2Hkv)*Dh]      (only with qkv_bias, Qwen2)
      w_gate_up [L, D, 2F]        w_down [L, F, D]     (gate, then up)

The projections that read the same input are one matrix (`fuse_projections`): one matmul
instead of three (or two) is faster on every backend.

The forward reads and writes KV through `jkv.attention.layer_kv` (one `attend` per layer: append
and attention, token tiers or not), nothing else about requests or pages.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jkv.attention.layer_kv import LayerKV, attend, join_shared, split_shared
from jkv.config import ModelConfig
from jkv.models.family import ModelFamily
from jkv.models.rope import apply_rope, inv_frequencies, rope_tables, rotate
from jkv.models.tensor_parallel import shard_params

Params = dict


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)


def mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU, gate and up projections in one matrix [D, 2F] (or [D, 2, F]: split along F
    over a tensor-parallel mesh, `tensor_parallel`)."""
    if w_gate_up.ndim == 3:
        gate, up = jnp.moveaxis(jnp.einsum("...d,dkf->...kf", x, w_gate_up), -2, 0)
    else:
        gate, up = jnp.split(x @ w_gate_up, 2, axis=-1)
    return (jax.nn.silu(gate) * up) @ w_down


def fuse_projections(layers: dict) -> dict:
    """Stacked per-layer weights with separate wq, wk, wv (bq, bk, bv) and w_gate, w_up, as
    loaders read them, into this module's layout (numpy or jax arrays)."""
    xp = np if all(isinstance(w, np.ndarray) for w in layers.values()) else jnp
    out = {k: w for k, w in layers.items()
           if k not in ("wq", "wk", "wv", "bq", "bk", "bv", "w_gate", "w_up")}
    out["wqkv"] = xp.concatenate([layers["wq"], layers["wk"], layers["wv"]], axis=-1)
    if "bq" in layers:
        out["bqkv"] = xp.concatenate([layers["bq"], layers["bk"], layers["bv"]], axis=-1)
    out["w_gate_up"] = xp.concatenate([layers["w_gate"], layers["w_up"]], axis=-1)
    return out


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            valid: jax.Array, kv: LayerKV,
            attention_backend: str = "xla") -> tuple[jax.Array, LayerKV]:
    """Run tokens [B, T] at `positions` [B, T] through every layer over a paged KV cache.

    Each row's valid tokens come first and continue its sequence: positions[b, t] =
    positions[b, 0] + t, positions[b, 0] being the tokens it already holds. `kv` holds every
    layer's KV of the rows (`LayerKV` with a layer axis after the batch axis): its page
    tables must already cover every valid position (see `jkv.kv.allocator.reserve`). Padding tokens
    (`valid` False) are not kept. Returns (final-normed hidden states [B, T, D], kv after the
    step). jit with `cfg` and `attention_backend` static. The layers run as one scan; `layer`
    runs one of them, for callers that dispatch layer by layer.
    """
    x = embed(params, tokens)
    rope = positional_tables(cfg, positions)
    shared, rest = split_shared(kv)
    per_layer = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), rest)

    def body(carry, xs):
        x, shared = carry
        weights, layer_kv = xs
        x, layer_kv = layer(weights, cfg, x, join_shared(shared, layer_kv), positions, valid,
                            rope, attention_backend)
        shared, rest = split_shared(layer_kv)
        return (x, shared), rest

    (x, shared), rest = jax.lax.scan(body, (x, shared), (params["layers"], per_layer))
    kv = join_shared(shared, jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1), rest))
    return final_norm(params, cfg, x), kv


def layer_weights(params: Params, index: jax.Array | int) -> Params:
    """Layer `index`'s weights out of the stacked `params["layers"]` (index may be traced)."""
    return jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, index, keepdims=False),
                        params["layers"])


def positional_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The rotary tables of positions [B, T] that every layer uses (`rope_tables`)."""
    inv_freq = jnp.asarray(inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    return rope_tables(positions, inv_freq)


def project_qkv(weights: Params, cfg: ModelConfig, x: jax.Array,
                rope: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A layer's queries, keys (both rotated) and values of hidden states x [B, T, D]:
    [B, T, heads, head_dim] each (KV heads for keys and values)."""
    b, t, _ = x.shape
    h = rms_norm(x, weights["attn_norm"], cfg.rms_norm_eps)
    if weights["wqkv"].ndim == 3:
        return _grouped_qkv(weights, cfg, h, rope)
    qkv = h @ weights["wqkv"]
    if cfg.qkv_bias:
        qkv = qkv + weights["bqkv"]
    q_end = cfg.num_heads * cfg.head_dim
    q, k, v = jnp.split(qkv, [q_end, q_end + cfg.num_kv_heads * cfg.head_dim], axis=-1)
    q = rotate(q.reshape(b, t, cfg.num_heads, cfg.head_dim), rope)
    k = rotate(k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim), rope)
    return q, k, v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)


def _grouped_qkv(weights: Params, cfg: ModelConfig, h: jax.Array,
                 rope: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`project_qkv` of normed h over projections grouped by KV head, [D, Hkv, (G + 2) *
    Dh] (`tensor_parallel.shard_params`: a device split of the KV heads holds whole groups)."""
    b, t, _ = h.shape
    qkv = jnp.einsum("btd,dhe->bthe", h, weights["wqkv"])
    if cfg.qkv_bias:
        qkv = qkv + weights["bqkv"]
    gq = cfg.num_heads // cfg.num_kv_heads * cfg.head_dim
    q, k, v = jnp.split(qkv, [gq, gq + cfg.head_dim], axis=-1)
    return rotate(q.reshape(b, t, cfg.num_heads, cfg.head_dim), rope), rotate(k, rope), v


def layer(weights: Params, cfg: ModelConfig, x: jax.Array, kv: LayerKV, positions: jax.Array,
          valid: jax.Array, rope: tuple[jax.Array, jax.Array],
          attention_backend: str = "xla") -> tuple[jax.Array, LayerKV]:
    """One layer with its own `weights` (`layer_weights`) on hidden states x [B, T, D] over
    that layer's KV (`LayerKV`), `rope` the `positional_tables` of `positions`. Returns
    (x, kv after the step)."""
    b, t, _ = x.shape
    q, k, v = project_qkv(weights, cfg, x, rope)
    attn, kv = attend(q, k, v, kv, positions, valid, 1.0 / math.sqrt(cfg.head_dim),
                      attention_backend)
    x = x + attn.reshape(b, t, -1) @ weights["wo"]
    h = rms_norm(x, weights["mlp_norm"], cfg.rms_norm_eps)
    x = x + mlp(h, weights["w_gate_up"], weights["w_down"])
    return x, kv


def final_norm(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


def lm_head(params: Params, hidden: jax.Array) -> jax.Array:
    """Hidden states [..., D] -> float32 logits [..., V] (tied or untied head)."""
    w = params["lm_head"] if "lm_head" in params else params["embed"].T
    return (hidden @ w).astype(jnp.float32)


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    return params["embed"][tokens]


def rotate_keys(cfg: ModelConfig):
    """Keys [B, T, H, D] rotated to positions [B, T] (a rotation by a position difference
    moves them)."""
    return partial(apply_rope, inv_freq=jnp.asarray(
        inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)))


LLAMA = ModelFamily(name="llama", forward=forward, embed=embed, positional=positional_tables,
                    layer_weights=layer_weights, layer=layer, final_norm=final_norm,
                    logits=lm_head, rotate_keys=rotate_keys, shard=shard_params)
