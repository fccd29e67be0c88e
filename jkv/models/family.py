"""The interface between a model family and the engine's model runner (`jkv.engine.runner`).

A family (`jkv.models.llama.LLAMA`) is one module of pure functions over a params pytree
whose per-layer weights are stacked under `params["layers"]`; the runner calls nothing else
of it, so a new family is one file here plus a loader entry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from jax.sharding import Mesh

from jkv.config import ModelConfig
from jkv.kv.sharding import make_mesh


class ModelFamily(NamedTuple):
    """What the runner calls (cfg: `jkv.config.ModelConfig`; KV through `jkv.attention.layer_kv`).

    forward(params, cfg, tokens, positions, valid, kv, backend)
        -> (final-normed hidden [B, T, D], kv): every layer in one scan (kv: the rows'
        `jkv.attention.layer_kv.LayerKV` with a layer axis after the batch axis).
    embed(params, tokens) -> x;  positional(cfg, positions) -> what every layer is given
    layer_weights(params, index) -> one layer's weights (index may be traced)
    layer(weights, cfg, x, kv, positions, valid, positional, backend) -> (x, kv): one
          layer over its `LayerKV`
    final_norm(params, cfg, x) -> x;  logits(params, h) -> [B, V] float32
    rotate_keys(cfg) -> f(k [B, T, H, D], positions [B, T]): keys re-rotated to positions
        (`jkv.kv.rebase` moves saved KV with it)
    shard(params, cfg, mesh) -> the params split over a tensor-parallel mesh by KV head
        (`jkv.kv.sharding`), in a layout its layer functions read
    """

    name: str
    forward: Callable
    embed: Callable
    positional: Callable
    layer_weights: Callable
    layer: Callable
    final_norm: Callable
    logits: Callable
    rotate_keys: Callable
    shard: Callable


def split_params(family: ModelFamily, params: dict, cfg: ModelConfig,
                 tensor_parallel: int) -> tuple[dict, Mesh | None]:
    """(params, mesh) for `tensor_parallel` devices: the params split over a mesh of them
    (`family.shard`), or as they are and None for one; ValueError naming `tensor_parallel`
    for a count the devices or the model cannot take."""
    mesh = make_mesh(tensor_parallel, cfg.num_kv_heads)
    return (params if mesh is None else family.shard(params, cfg, mesh)), mesh
