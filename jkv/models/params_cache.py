"""Converted-params cache: a second start skips GGUF dequantization (orbax-checkpoint).

Entries live under `$JKV_CACHE_DIR/params` (default `~/.cache/jkv/params`), keyed by the model
file's path, size and mtime and the target dtype. A broken entry is rebuilt, never trusted.
An entry holds the same arrays whether it was written from device or host params, so either
placement reads what the other wrote.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jkv.config import ModelConfig, RopeScaling
from jkv.models.llama import Params
from jkv.models.loaders import default_model_path, load_model, to_device, to_host

log = logging.getLogger(__name__)
_FORMAT_VERSION = 2  # 2: fused projections (wqkv, w_gate_up)


def cache_home() -> Path:
    """jkv's cache directory: `$JKV_CACHE_DIR`, default `~/.cache/jkv`."""
    return Path(os.environ.get("JKV_CACHE_DIR", Path.home() / ".cache" / "jkv"))


def cache_root() -> Path:
    return cache_home() / "params"


def file_key(path: Path, salt: str) -> str:
    """A key that changes when the model file (or a directory's weight files) changes."""
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in (".gguf", ".safetensors", ".json"))
    h = hashlib.sha256(f"v{_FORMAT_VERSION}:{salt}".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def _cfg_from_json(d: dict) -> ModelConfig:
    if d.get("rope_scaling"):
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    return ModelConfig(**d)


def _restore(path: Path, on_host: bool) -> Params:
    """An entry's arrays: on the default device, or as numpy arrays read straight from the
    files (no device ever holds the whole tree)."""
    import orbax.checkpoint as ocp

    if not on_host:
        return ocp.StandardCheckpointer().restore(path)
    ckpt = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    meta = ckpt.metadata(path)
    tree = getattr(meta, "item_metadata", meta)  # a step's metadata, or the tree's itself
    tree = getattr(tree, "tree", tree)
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return ckpt.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))


def _save(entry: Path, cfg: ModelConfig, params: Params) -> None:
    """Write an entry (numpy or device params alike); a failure only warns."""
    import orbax.checkpoint as ocp

    try:
        shutil.rmtree(entry, ignore_errors=True)
        entry.mkdir(parents=True)
        ckpt = ocp.StandardCheckpointer()
        ckpt.save((entry / "params").resolve(), params)
        ckpt.wait_until_finished()
        (entry / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
        (entry / "done").write_text("ok")
    except Exception as exc:  # the cache is an optimisation; a failure is not fatal
        log.warning("could not write converted-params cache %s: %s", entry, exc)


def load_params(path: str | os.PathLike | None, dtype=jnp.bfloat16, use_cache: bool = True,
                on_host: bool = False) -> tuple[ModelConfig, Params]:
    """Load a model (None = embedded default) as arrays of `dtype`, through the cache: jax
    arrays on the default device, or with `on_host` numpy arrays in host memory, for a
    tensor-parallel engine to send each device only its part of a model that may not fit
    one device."""
    p = default_model_path() if path is None else Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist")
    place = to_host if on_host else to_device
    entry = cache_root() / file_key(p, jnp.dtype(dtype).name)
    if use_cache and (entry / "done").exists():
        try:
            cfg = _cfg_from_json(json.loads((entry / "config.json").read_text()))
            return cfg, place(_restore((entry / "params").resolve(), on_host), dtype)
        except Exception as exc:  # a torn or foreign entry: rebuild it
            log.warning("converted-params cache entry %s is unreadable (%s); rebuilding",
                        entry, exc)
    cfg, np_params = load_model(p)
    params = place(np_params, dtype)
    if use_cache:
        _save(entry, cfg, params)
    return cfg, params
