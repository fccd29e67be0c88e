"""Configuration as data: frozen dataclasses, one place for defaults.

The same field names appear as `LLM(...)` keyword arguments and as server flags
(`max_model_len` <-> `--max-model-len`).
"""

from __future__ import annotations

import dataclasses
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

    Only full precision (16/16) is implemented by this release; quantized formats come with
    the Pallas kernels.
    """

    k_bits: int = 16
    v_bits: int = 16
    group: int = 64

    def __post_init__(self) -> None:
        for name in ("k_bits", "v_bits"):
            if getattr(self, name) not in (16, 8, 4, 2):
                raise ValueError(f"KVFormat.{name} must be one of 16, 8, 4, 2, "
                                 f"got {getattr(self, name)}")

    @classmethod
    def parse(cls, name: str) -> KVFormat:
        """`auto`/`bf16` -> model dtype pages; other names are reserved for quantized pages."""
        if name in ("auto", "bf16", "fp16", "fp32"):
            return cls()
        raise ValueError(
            f"kv_format={name!r} is not supported yet; this release stores full-precision "
            "pages ('auto')")


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
