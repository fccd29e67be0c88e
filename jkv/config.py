"""Configuration as data: frozen dataclasses, one place for defaults.

The same field names appear as `LLM(...)` keyword arguments and as server flags
(`max_model_len` <-> `--max-model-len`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field


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


@dataclass(frozen=True)
class KVFormat:
    """How one page stores keys and values. Bits in {16, 8, 4, 2}; 16 means the model dtype.

    Quantized keys carry a scale and zero point per (page, channel); quantized values per
    (token, group of `group` channels). `group` is capped at head_dim where it is used.
    """

    k_bits: int = 16
    v_bits: int = 16
    group: int = 64

    def __post_init__(self) -> None:
        for name in ("k_bits", "v_bits"):
            if getattr(self, name) not in (16, 8, 4, 2):
                raise ValueError(f"KVFormat.{name} must be one of 16, 8, 4, 2, "
                                 f"got {getattr(self, name)}")
        if self.group <= 0 or self.group & (self.group - 1):
            raise ValueError(f"KVFormat.group must be a power of two, got {self.group}")

    @classmethod
    def parse(cls, name: str) -> KVFormat:
        """A format by name: auto/bf16 (model dtype), int8, int4, k8v8, k4v4, k8v4, k4v2."""
        if name not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {sorted(KV_FORMATS)}, got {name!r}")
        return KV_FORMATS[name]

    @property
    def name(self) -> str:
        if self.k_bits == self.v_bits:
            return "auto" if self.k_bits == 16 else f"int{self.k_bits}"
        return f"k{self.k_bits}v{self.v_bits}"

    @property
    def quantized(self) -> bool:
        return self.k_bits < 16 or self.v_bits < 16

    def bytes_per_token(self, head_dim: int, dtype_bytes: int) -> float:
        """Bytes one token of one KV head takes in a full page, scales and zeros included."""
        group = min(self.group, head_dim)
        k = head_dim * dtype_bytes if self.k_bits == 16 else head_dim * self.k_bits / 8
        v = head_dim * dtype_bytes if self.v_bits == 16 else head_dim * self.v_bits / 8
        if self.v_bits < 16:
            v += 2 * 4 * head_dim // group  # f32 scale and zero per group
        return k + v  # key scales are per page: `key_page_overhead_bytes`

    def key_page_overhead_bytes(self, head_dim: int) -> int:
        return 2 * 4 * head_dim if self.k_bits < 16 else 0


KV_FORMATS: dict[str, KVFormat] = {
    "auto": KVFormat(16, 16), "bf16": KVFormat(16, 16),
    "int8": KVFormat(8, 8), "k8v8": KVFormat(8, 8),
    "int4": KVFormat(4, 4), "k4v4": KVFormat(4, 4),
    "k8v4": KVFormat(8, 4), "k4v2": KVFormat(4, 2),
}


# plain jnp; the Pallas kernels (interpreted on CPU); auto: pallas on a GPU, else xla
ATTENTION_BACKENDS = ("auto", "xla", "pallas")
EXECUTIONS = ("scan", "layerwise")  # all layers in one compiled step; one dispatch per layer


@dataclass(frozen=True)
class CacheConfig:
    """The device page pool: pages hold `page_size` tokens of one (layer, KV head)."""

    page_size: int = 16
    kv_cache_bytes: int = 512 * 1024 * 1024
    kv_format: KVFormat = field(default_factory=KVFormat)

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"CacheConfig.page_size must be a power of two, got {self.page_size}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"CacheConfig.kv_cache_bytes must be positive, "
                             f"got {self.kv_cache_bytes}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step work: `max_num_batched_tokens` tokens (decodes and prefill chunks together;
    None: the engine's prefill chunk)."""

    max_num_batched_tokens: int | None = None
    # restore a store hit only when loading it is expected to beat recomputing it (measured
    # rates); False: restore every hit
    restore_planning: bool = True

    def __post_init__(self) -> None:
        n = self.max_num_batched_tokens
        if n is not None and (not isinstance(n, int) or n < 1):
            raise ValueError(f"SchedulerConfig.max_num_batched_tokens must be a positive "
                             f"integer or None, got {n!r}")


EVICTION_POLICIES = ("lru", "fifo", "scheduler")  # jkv.store.placement
HOST_CACHE_SHARE = 4  # the default host tier: a quarter of the memory available at start,
HOST_CACHE_CAP = 8 << 30  # at most 8 GiB


def default_host_cache_bytes() -> int:
    """A quarter of the host memory available now, at most 8 GiB (0 where unknown)."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
    return min(available // HOST_CACHE_SHARE, HOST_CACHE_CAP)


@dataclass(frozen=True)
class StoreConfig:
    """Where finished requests' KV is kept off the device (`jkv.store`).

    host_cache_bytes: the host DRAM tier's budget (0: no host tier; None: a quarter of the
    memory available at start, at most 8 GiB, so a chat's history survives device-cache
    eviction out of the box). store_dir: a directory
    for the persistent tier (tensorstore OCDBT); store_spec: any tensorstore kvstore spec or
    URL instead (``s3://bucket/prefix/``, a dict). disk_cache_bytes: the persistent tier's
    budget. eviction_policy: which entry a full tier gives up (`jkv.store.placement`).
    """

    host_cache_bytes: int | None = None
    disk_cache_bytes: int = 64 << 30
    store_dir: str | None = None
    store_spec: str | dict | None = None
    eviction_policy: str = "scheduler"

    def __post_init__(self) -> None:
        if self.host_cache_bytes is None:
            object.__setattr__(self, "host_cache_bytes", default_host_cache_bytes())
        for name in ("host_cache_bytes", "disk_cache_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"StoreConfig.{name} must be an integer >= 0, got {value!r}")
        if self.store_dir is not None and self.store_spec is not None:
            raise ValueError("give StoreConfig.store_dir or StoreConfig.store_spec, not both")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"StoreConfig.eviction_policy must be one of {EVICTION_POLICIES}, "
                             f"got {self.eviction_policy!r}")

    @property
    def persistent(self) -> str | dict | None:
        """The persistent tier's location, or None."""
        return self.store_dir if self.store_spec is None else self.store_spec

    @property
    def enabled(self) -> bool:
        return self.host_cache_bytes > 0 or (self.persistent is not None
                                             and self.disk_cache_bytes > 0)
