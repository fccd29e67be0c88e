"""The model a decode benchmark runs: the embedded SmolLM2 (real weights; prompts cut from
this machine's Python sources) or, with `--preset`, random weights of a known shape (random
prompt ids), for what only the shape decides: step times on a GPU at Llama-3-8B's shape."""

from __future__ import annotations

import argparse
import sysconfig
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jkv.config import ATTENTION_BACKENDS, PRESETS, ModelConfig
from jkv.models import load_params
from jkv.models.loaders import default_model_path, random_params
from jkv.models.tokenizer import load_tokenizer

Prompts = Callable[[int, int], list[list[int]]]


def prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """`n` prompts of `length` tokens from the standard library's sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for path in sorted(stdlib.glob("*.py")):
        ids += tokenizer.encode(path.read_text(errors="replace"))
        if len(ids) >= n * length:
            break
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                    help="auto: the Pallas kernels on a GPU, plain jnp (xla) on CPU")
    ap.add_argument("--preset", default=None, choices=sorted(PRESETS),
                    help="random weights of this shape instead of the embedded SmolLM2's real "
                         "ones, with random prompt ids (llama3-8b: the GPU table)")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                    help="model dtype (default: float32 on CPU, bfloat16 on an accelerator)")


def result_stem(benchmark: str, args: argparse.Namespace) -> str:
    """<benchmark>-<device>[-<preset>]: the results file's name before its date."""
    device = jax.devices()[0].device_kind.replace(" ", "_").lower()
    return f"{benchmark}-{device}" + (f"-{args.preset}" if args.preset else "")


def load_model(args: argparse.Namespace) -> tuple[ModelConfig, dict, jnp.dtype, Prompts, str]:
    """(config, params, dtype, prompts(n, length), a name for tables) from add_model_args'."""
    dtype = jnp.dtype(args.dtype or ("float32" if jax.default_backend() == "cpu"
                                     else "bfloat16"))
    if args.preset is None:
        cfg, params = load_params(None, dtype)
        tokenizer = load_tokenizer(default_model_path())
        return cfg, params, dtype, lambda n, length: prompts(tokenizer, n, length), \
            f"SmolLM2-135M {dtype.name}"
    cfg = PRESETS[args.preset]
    params = random_params(cfg, 0, dtype)

    def random_prompts(n: int, length: int) -> list[list[int]]:
        return np.random.default_rng(0).integers(0, cfg.vocab_size, (n, length)).tolist()

    return cfg, params, dtype, random_prompts, f"{args.preset} (random weights) {dtype.name}"
