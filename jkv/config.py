"""Configuration as data: frozen dataclasses, one place for defaults.

The fields of the user-facing configs (`USER_CONFIGS`: LoadConfig, EngineConfig, CacheConfig,
SchedulerConfig, StoreConfig) carry their defaults and help text; `OPTIONS` reads them off,
and `LLM(...)` takes them as keyword arguments and the server as flags (`max_model_len` <->
`--max-model-len`). Each config validates its own fields (ValueError naming `Config.field`),
with the checks of `jkv.config_checks`; StoreConfig, the KV store's, lives in
`jkv.store_config`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from jkv.config_checks import check_choices_and_flags, is_int, is_pow2, parse_bytes, require
from jkv.kv.format import KV_FORMATS, KVFormat
from jkv.policies import POLICIES, policy_help
from jkv.store_config import HOST_CACHE_CAP as HOST_CACHE_CAP  # re-exported: tests read it here
from jkv.store_config import StoreConfig


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_type: llama3` in HF configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=8192),
    "llama3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=8192),
    "llama3.1-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling=RopeScaling(), rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=131072),
}



# which tokens' KV is kept, and how finely (CacheConfig.kv_policy): one module each
KV_POLICIES = tuple(POLICIES)

# plain jnp; the Pallas kernels (interpreted on CPU); auto: pallas on a GPU, else xla
ATTENTION_BACKENDS = ("auto", "xla", "pallas")
EXECUTIONS = ("scan", "layerwise")  # all layers in one compiled step; one dispatch per layer
DTYPES = ("auto", "bfloat16", "float16", "float32")  # auto: bfloat16 on an accelerator, else f32
DEFAULT_MAX_MODEL_LEN = 8192  # max_model_len None: the model's limit, at most this

# User-facing settings are the fields of the configs in `USER_CONFIGS`: each field's default
# and its help (`metadata["help"]`, where `name` in backquotes refers to another setting) are
# written once, on the field (StoreConfig's in `jkv.store_config`); `LLM(...)` takes them as
# keyword arguments and the server as flags (`OPTIONS`). metadata["choices"]: the values a
# field allows.





RANDOM_MODEL = "random:"  # LoadConfig.model's prefix for random weights at a preset's shapes


@dataclass(frozen=True)
class LoadConfig:
    """Which model `LLM` loads, and how."""

    model: str | os.PathLike | None = field(default=None, metadata={
        "help": "a .gguf file or a Hugging Face model directory; default: the embedded "
                "SmolLM2-135M-Instruct. random:<preset> (e.g. random:llama3-8b): random "
                "weights at a known model's shapes, no tokenizer (prompts as token ids): for "
                "benchmarks"})
    dtype: str = field(default="auto", metadata={
        "help": "dtype of the weights and the KV cache; auto: bfloat16 on an accelerator, "
                "float32 on CPU",
        "choices": DTYPES})
    params_cache: bool = field(default=True, metadata={
        "help": "keep converted weights in jkv's cache directory ($JKV_CACHE_DIR, default "
                "~/.cache/jkv), so the next start skips converting them"})

    def __post_init__(self) -> None:
        require(self, "model", self.model is None or isinstance(self.model, str | os.PathLike),
                "a path or None")
        preset = self.random_preset
        require(self, "model", preset is None or preset in PRESETS,
                f"random:<preset> with a preset of {sorted(PRESETS)}")
        check_choices_and_flags(self)

    @property
    def random_preset(self) -> str | None:
        """The preset of a random:<preset> model, else None."""
        if isinstance(self.model, str) and self.model.startswith(RANDOM_MODEL):
            return self.model[len(RANDOM_MODEL):]
        return None


@dataclass(frozen=True)
class EngineConfig:
    """The engine: sequence length, batch, attention path, prefill chunk, seed, device prefix
    cache, execution, tensor parallelism."""

    max_model_len: int | None = field(default=None, metadata={
        "help": f"longest sequence (prompt + generated tokens); default: the model's limit, at "
                f"most {DEFAULT_MAX_MODEL_LEN}"})
    max_num_seqs: int = field(default=8, metadata={
        "help": "most sequences decoded together in one batch"})
    attention_backend: str = field(default="auto", metadata={
        "help": "attention implementation: auto (pallas on a GPU, xla elsewhere), xla (plain "
                "jnp) or pallas (the Pallas kernels; interpreted, so slow, on CPU)",
        "choices": ATTENTION_BACKENDS})
    prefill_chunk: int = field(default=512, metadata={
        "help": "longest prompt piece prefilled in one step (a power of two)"})
    seed: int = field(default=0, metadata={
        "help": "base PRNG seed, for requests that set no seed"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "keep finished requests' full KV pages on the device, keyed by chained block "
                "hashes, so a later prompt with the same prefix (the next turn of a chat, "
                "resent whole) skips recomputing it"})
    device_cache_bytes: int | None = field(default=None, metadata={
        "help": "most device memory the prefix cache keeps (finished requests' pages); "
                "default: what running requests leave of `kv_cache_bytes`"})
    execution: str = field(default="scan", metadata={
        "help": "how layers run: scan: every layer in one compiled call (on CPU layer by "
                "layer anyway: faster there), restored KV written before the step; layerwise: one "
                "dispatch per layer, restored KV written layer by layer while earlier layers "
                "compute (same outputs)",
        "choices": EXECUTIONS})
    tensor_parallel: int = field(default=1, metadata={
        "help": "devices to split the model over (tensor parallelism), for a model too large "
                "for one: a mesh of the first N devices, weights and KV pages split by KV head "
                "(N must divide the model's KV heads; `kv_cache_bytes` is then the total over "
                "them); 1: one device, no mesh"})

    def __post_init__(self) -> None:
        n = self.max_model_len
        require(self, "max_model_len", n is None or is_int(n) and n >= 2,
                "an integer >= 2 or None")
        require(self, "max_num_seqs", is_int(self.max_num_seqs) and self.max_num_seqs >= 1,
                "an integer >= 1")
        require(self, "prefill_chunk", is_pow2(self.prefill_chunk), "a power of two")
        require(self, "seed", is_int(self.seed), "an integer")
        require(self, "tensor_parallel", is_int(self.tensor_parallel)
                and self.tensor_parallel >= 1, "an integer >= 1")
        n = self.device_cache_bytes
        require(self, "device_cache_bytes", n is None or is_int(n) and n >= 0,
                "an integer >= 0 or None")
        check_choices_and_flags(self)

    def resolve_max_model_len(self, limit: int) -> int:
        """max_model_len for a model whose positions end at `limit` (None: `limit`, at most
        DEFAULT_MAX_MODEL_LEN); ValueError if it does not fit."""
        if self.max_model_len is None:
            return min(limit, DEFAULT_MAX_MODEL_LEN)
        if not 2 <= self.max_model_len <= limit:
            raise ValueError(f"EngineConfig.max_model_len must be in [2, {limit}] for this "
                             f"model, got {self.max_model_len}")
        return self.max_model_len


@dataclass(frozen=True)
class CacheConfig:
    """The device page pool: pages hold `page_size` tokens of one (layer, KV head).

    kv_format is a KVFormat; a name from KV_FORMATS (the user-facing option) becomes its
    KVFormat here, the one place names map to formats.
    """

    page_size: int = field(default=16, metadata={
        "help": "tokens per KV cache page (a power of two)"})
    kv_cache_bytes: int = field(default=512 * 1024 * 1024, metadata={
        "help": "device memory for the KV cache, in bytes"})
    kv_format: KVFormat | str = field(default="auto", metadata={
        "help": "how KV pages are stored: auto = the model dtype; bf16 = bfloat16 whatever "
                "the model dtype (half a float32 model's bytes); int8, int4 (= k8v8, "
                "k4v4); k8v4, k4v2 = keys finer than values; k8v4t, k4v2t (k4v8t, k2v4t: "
                "controls) = keys scaled per token, so tokens move alone (LeanKV's tiers), "
                "keys and values kept under a Hadamard rotation. Full pages are quantized, "
                "the page being filled stays in the model dtype",
        "choices": tuple(sorted(KV_FORMATS))})

    kv_policy: str = field(default="none", metadata={
        "help": "which tokens' KV is kept, and how finely: " + policy_help() + ". A policy "
                "that drops or moves single tokens keeps an ended sequence whole, tiers and "
                "all (prefix caching on the device, the KV store off it), for its next turn",
        "choices": KV_POLICIES})
    # defaults chosen by measurement (best perplexity and top-1 agreement within a byte
    # budget), see `benchmarks/kv_fidelity.py --docs calibration`
    kv_alpha_high: float = field(default=5.0, metadata={
        "help": "leankv's high-tier threshold: a token stays in the high tier while its mean "
                "attention is at least this many times the uniform share 1/n"})
    kv_alpha_low: float = field(default=0.001, metadata={
        "help": "leankv's low-tier threshold: below `kv_alpha_high`, a token is kept in the low "
                "tier while its mean attention is at least this many times 1/n, else pruned "
                "(0: never pruned)"})
    kv_recent_window: int = field(default=64, metadata={
        "help": "recent window of token policies: the newest tokens, kept (at high precision) "
                "whatever their attention (at least `page_size`); a policy that observes the "
                "prompt's end reads significance from the prompt's last this many queries"})
    kv_placement_interval: int = field(default=16, metadata={
        "help": "steps between token placements: token policies' decode steps between two "
                "placements of the tokens that left the recent window (1: every step, as "
                "LeanKV's Algorithm 1; more spreads the pass over every held token's "
                "attention across that many steps, and a token may stay that many steps "
                "longer at high precision)"})
    kv_sink_tokens: int = field(default=4, metadata={
        "help": "attention sinks: the first tokens, which streaming and leankv always keep "
                "(leankv: at high precision, as Algorithm 1's 1/i threshold would never let "
                "them meet theirs)"})
    kv_heavy_ratio: float = field(default=0.2, metadata={
        "help": "share of heavy hitters: top-k token policies (h2o) keep this share of a "
                "sequence's tokens beside the recent window, the same for every head"})

    def __post_init__(self) -> None:
        require(self, "page_size", is_pow2(self.page_size), "a power of two")
        require(self, "kv_cache_bytes", is_int(self.kv_cache_bytes) and self.kv_cache_bytes > 0,
                "a positive integer")
        require(self, "kv_policy", self.kv_policy in POLICIES, f"one of {tuple(POLICIES)}")
        if not isinstance(self.kv_format, KVFormat):
            require(self, "kv_format", self.kv_format in KV_FORMATS,
                    f"a KVFormat or one of {sorted(KV_FORMATS)}")
            name = self.kv_format
            if name == "auto":  # the policy's own (LeanKV's high tier, KIVI's 2 bits)
                name = POLICIES[self.kv_policy].default_format or name
            object.__setattr__(self, "kv_format", KVFormat.parse(name))
        for name in ("kv_alpha_high", "kv_alpha_low"):
            value = getattr(self, name)
            require(self, name, isinstance(value, int | float) and not isinstance(value, bool)
                    and math.isfinite(value) and value >= 0, "a number >= 0")
        if self.kv_alpha_low > self.kv_alpha_high:
            raise ValueError(f"CacheConfig.kv_alpha_low ({self.kv_alpha_low}) must not exceed "
                             f"kv_alpha_high ({self.kv_alpha_high})")
        require(self, "kv_recent_window", is_int(self.kv_recent_window)
                and self.kv_recent_window >= self.page_size,
                f"an integer >= page_size ({self.page_size})")
        require(self, "kv_placement_interval", is_int(self.kv_placement_interval)
                and self.kv_placement_interval >= 1, "an integer >= 1")
        require(self, "kv_sink_tokens", is_int(self.kv_sink_tokens)
                and self.kv_sink_tokens >= 0, "an integer >= 0")
        r = self.kv_heavy_ratio
        require(self, "kv_heavy_ratio", isinstance(r, int | float) and not isinstance(r, bool)
                and 0 <= r <= 1, "a number in [0, 1]")
        POLICIES[self.kv_policy].check(self)

    @property
    def token_tiers(self) -> bool:
        """Whether pages hold token tiers (a token's place decided by the policy as it leaves
        the recent window) rather than every token of the sequence in order."""
        return POLICIES[self.kv_policy].token_tiers


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step work and restore decisions."""

    max_num_batched_tokens: int | None = field(default=None, metadata={
        "help": "tokens per step, decodes and prefill chunks together; default: "
                "`prefill_chunk`"})
    restore_planning: bool = field(default=True, metadata={
        "help": "restore a stored KV hit only where loading beats recomputing, as expected "
                "from measured load and prefill rates; off: restore every hit"})
    layer_offload: bool = field(default=True, metadata={
        "help": "LayerKV's layer-wise offload: when KV pages run short, admit a prompt with "
                "only some of its layers' KV on the device (the others written to host memory "
                "as each layer finishes; a prompt longer than a prefill chunk runs a few "
                "layers a step over all its tokens) and move running requests' layers to host "
                "memory instead of preempting them; they come back as pages free up. Off: "
                "wait or preempt and recompute (for comparison). Under a token-tier KV policy "
                "a prompt runs chunk by chunk and each layer on the host is placed while it "
                "is brought in for its turn"})
    store_read_ahead: bool = field(default=True, metadata={
        "help": "read stored KV hits ahead: read (and checksum) a hit on the store's own "
                "thread while its request waits, so no step waits on a store tier; off: read "
                "at admission, on the serving loop (for comparison)"})

    def __post_init__(self) -> None:
        n = self.max_num_batched_tokens
        require(self, "max_num_batched_tokens", n is None or is_int(n) and n >= 1,
                "a positive integer or None")
        check_choices_and_flags(self)


# ---------------------------------------------------------------------------- user options

USER_CONFIGS = (LoadConfig, EngineConfig, CacheConfig, SchedulerConfig, StoreConfig)


@dataclass(frozen=True)
class Option:
    """One user-facing setting, read off its config's field: an `LLM(...)` keyword argument
    and a server flag (`max_model_len` <-> `--max-model-len`)."""

    name: str
    config: type
    default: Any
    help: str
    annotation: Any  # the field's type
    value_type: type  # bool, int, float or str: what a flag's text parses as
    choices: tuple | None = None
    default_note: Callable[[], str] | None = None  # a default resolved at start, for --help

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _options() -> tuple[Option, ...]:
    out = []
    for config in USER_CONFIGS:
        hints = typing.get_type_hints(config)
        for f in dataclasses.fields(config):
            hint = hints[f.name]
            args = typing.get_args(hint) or (hint,)
            value_type = next((t for t in (bool, int, float) if t in args), str)
            out.append(Option(f.name, config, f.default, f.metadata["help"], hint, value_type,
                              f.metadata.get("choices"), f.metadata.get("default_note")))
    names = [o.name for o in out]
    assert len(set(names)) == len(names), "an option name appears in two configs"
    return tuple(out)


OPTIONS: tuple[Option, ...] = _options()  # in order: load, engine, cache, scheduler, store


def split_options(options: Mapping[str, Any], caller: str = "LLM.__init__()"
                  ) -> dict[type, dict[str, Any]]:
    """`options` sorted by the config each belongs to (every config of USER_CONFIGS has an
    entry); TypeError, as Python words it for `caller`, for a name that is no option."""
    by_name = {o.name: o for o in OPTIONS}
    out: dict[type, dict[str, Any]] = {config: {} for config in USER_CONFIGS}
    for name, value in options.items():
        if name not in by_name:
            raise TypeError(f"{caller} got an unexpected keyword argument {name!r}; valid "
                            f"ones: {', '.join(by_name)}")
        if name.endswith("_bytes"):  # sizes as text too: "512MiB", "8GiB"
            value = parse_bytes(value, f"{by_name[name].config.__name__}.{name}")
        out[by_name[name].config][name] = value
    return out
