"""The Llama family's weights split over a tensor-parallel mesh, by KV head.

The q, k and v projections are regrouped per KV head, [L, D, Hkv, (G + 2) * Dh] (a KV head's G
query heads, its key, its value: `llama.project_qkv` reads either layout), and split along
the KV heads, so each device computes whole GQA groups over its own KV pages. o_proj is split
along its input (the query heads, in the same order), the MLP's gate and up, [L, D, 2, F],
along F and its down projection along its input F. Embeddings, norms and the LM head are
whole on every device. XLA adds what that needs: an all-reduce after o_proj and after the
down projection.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jkv.config import ModelConfig
from jkv.kv.sharding import TP_AXIS

Params = dict

# each stacked layer weight's split (a leading layer axis); others are whole on every device
_SPLITS = {
    "wqkv": PartitionSpec(None, None, TP_AXIS),  # [L, D, Hkv, (G + 2) * Dh]
    "bqkv": PartitionSpec(None, TP_AXIS),  # [L, Hkv, (G + 2) * Dh]
    "wo": PartitionSpec(None, TP_AXIS),  # [L, Hq * Dh, D]
    "w_gate_up": PartitionSpec(None, None, None, TP_AXIS),  # [L, D, 2, F]
    "w_down": PartitionSpec(None, TP_AXIS),  # [L, F, D]
}


def _regroup(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Fused q, k, v columns [..., (Hq + 2 Hkv) * Dh] as [..., Hkv, (G + 2) * Dh]."""
    hkv, hd = cfg.num_kv_heads, cfg.head_dim
    q_end = cfg.num_heads * hd
    q, k, v = np.split(w, [q_end, q_end + hkv * hd], axis=-1)
    return np.concatenate([x.reshape(*w.shape[:-1], hkv, -1) for x in (q, k, v)], axis=-1)


def shard_params(params: Params, cfg: ModelConfig, mesh: Mesh) -> Params:
    """`params` (`llama`'s layout) regrouped and put on `mesh`, split as the module docstring
    says; ValueError naming `tensor_parallel` when the MLP's width does not divide."""
    n = mesh.size
    if cfg.intermediate_size % n:
        raise ValueError(f"EngineConfig.tensor_parallel={n} must divide the model's MLP "
                         f"width (intermediate_size {cfg.intermediate_size})")
    layers = {name: np.asarray(w) for name, w in params["layers"].items()}
    layers["wqkv"] = _regroup(layers["wqkv"], cfg)
    if "bqkv" in layers:
        layers["bqkv"] = _regroup(layers["bqkv"], cfg)
    gate_up = layers["w_gate_up"]
    layers["w_gate_up"] = gate_up.reshape(*gate_up.shape[:2], 2, -1)
    whole = NamedSharding(mesh, PartitionSpec())
    out = {name: jax.device_put(w, whole) for name, w in params.items() if name != "layers"}
    out["layers"] = {name: jax.device_put(w, NamedSharding(mesh, _SPLITS.get(name,
                                                                            PartitionSpec())))
                     for name, w in layers.items()}
    return out
