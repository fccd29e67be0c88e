"""KV page formats: how a page stores keys and values (`KVFormat`) and the formats by name."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

# Scales and zero points of quantized pages are computed in float32 and stored in float16:
# half the bytes of float32, and codes are computed against the stored values (the zero
# rounded down), so the quantization error stays within 1% of float32 scales'
# (`kv_quant.quantize_codes`). K/V values must stay within float16's range (+-65504).
SCALE_DTYPE = np.dtype(np.float16)


@dataclass(frozen=True)
class KVFormat:
    """How one page stores keys and values. Bits in {16, 8, 4, 2}; 16 means the model dtype,
    or bfloat16 with `bfloat16` whatever the model's (written cast, read back upcast).

    Quantized keys carry a scale and zero point per (page, channel), or with `token_keys`
    per (token, group of `group` channels) like values, so a token can move between pages
    on its own (LeanKV's tiers); quantized values per (token, group), all in `SCALE_DTYPE`.
    `group` is capped at head_dim where it is used. The arrays themselves:
    `jkv.kv.pages.KVPages`.

    `rotated` (per-token formats only): keys and values are stored after a fixed orthonormal
    rotation of the head dimension (`jkv.kv.rotation`), queries rotated alike and the
    attention output rotated back, so attention is unchanged while a few outlier channels no
    longer set a whole group's scale. Per-channel key scales exist for those outliers, so a
    per-channel format is never rotated.
    """

    k_bits: int = 16
    v_bits: int = 16
    group: int = 64
    token_keys: bool = False
    rotated: bool = False
    bfloat16: bool = False

    def __post_init__(self) -> None:
        for name in ("k_bits", "v_bits"):
            if getattr(self, name) not in (16, 8, 4, 2):
                raise ValueError(f"KVFormat.{name} must be one of 16, 8, 4, 2, "
                                 f"got {getattr(self, name)}")
        if self.group <= 0 or self.group & (self.group - 1):
            raise ValueError(f"KVFormat.group must be a power of two, got {self.group}")
        if self.token_keys and self.k_bits == 16:
            raise ValueError("KVFormat.token_keys needs quantized keys (k_bits < 16)")
        if self.rotated and not self.token_keys:
            raise ValueError("KVFormat.rotated needs token_keys: a rotation would spread "
                             "the outlier channels that per-channel key scales isolate")
        if self.bfloat16 and 16 not in (self.k_bits, self.v_bits):
            raise ValueError("KVFormat.bfloat16 needs a 16-bit side (k_bits or v_bits 16)")

    @classmethod
    def parse(cls, name: str) -> KVFormat:
        """A format by name: auto (model dtype), bf16 (bfloat16), int8, int4, k8v8, k4v4,
        k8v4, k4v2, and with per-token key scales (rotated) k8v4t, k4v2t, k4v8t, k2v4t."""
        if name not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {sorted(KV_FORMATS)}, got {name!r}")
        return KV_FORMATS[name]

    @property
    def name(self) -> str:
        """The format's name in `KV_FORMATS` (the first one), else spelled out."""
        for name, fmt in KV_FORMATS.items():
            if fmt == self:
                return name
        return (f"k{self.k_bits}v{self.v_bits}{'t' if self.token_keys else ''}"
                f"{'' if self.group == 64 else f'g{self.group}'}"
                f"{'-unrotated' if self.token_keys and not self.rotated else ''}"
                f"{'-bf16' if self.bfloat16 else ''}")

    def float_dtype(self, model_dtype) -> np.dtype:
        """The dtype a 16-bit side is stored in, for a model computing in `model_dtype`."""
        return np.dtype(ml_dtypes.bfloat16) if self.bfloat16 else np.dtype(model_dtype)

    @property
    def page_keys(self) -> bool:
        """Keys quantized with a scale per (page, channel): a page's tokens share them."""
        return self.k_bits < 16 and not self.token_keys

    @property
    def quantized(self) -> bool:
        return self.k_bits < 16 or self.v_bits < 16

    @property
    def halvable(self) -> bool:
        """Whether `halved` gives a low tier's format."""
        return self.token_keys and 4 <= min(self.k_bits, self.v_bits) <= max(
            self.k_bits, self.v_bits) <= 8

    def halved(self) -> KVFormat:
        """The low tier's format of a LeanKV pair: half the bits on both sides and twice the
        group, so a page of twice the tokens takes exactly this format's bytes."""
        if not self.halvable:
            raise ValueError(f"only formats with per-token keys and 4 or 8 bits on both sides "
                             f"halve, not {self.name}")
        return KVFormat(self.k_bits // 2, self.v_bits // 2, 2 * self.group, token_keys=True,
                        rotated=self.rotated)

    def bytes_per_token(self, head_dim: int, dtype_bytes: int) -> float:
        """Bytes one token of one KV head takes in a full page, scales and zeros included
        (`dtype_bytes`: the model dtype's)."""
        group = min(self.group, head_dim)
        dtype_bytes = 2 if self.bfloat16 else dtype_bytes
        k = head_dim * dtype_bytes if self.k_bits == 16 else head_dim * self.k_bits / 8
        v = head_dim * dtype_bytes if self.v_bits == 16 else head_dim * self.v_bits / 8
        if self.v_bits < 16:
            v += 2 * SCALE_DTYPE.itemsize * head_dim // group  # scale and zero per group
        if self.token_keys:
            k += 2 * SCALE_DTYPE.itemsize * head_dim // group
        return k + v  # per-channel key scales are per page: `key_page_overhead_bytes`

    def key_page_overhead_bytes(self, head_dim: int) -> int:
        """Bytes of a page's key scales and zero points (one each per channel)."""
        return 2 * SCALE_DTYPE.itemsize * head_dim if self.page_keys else 0


KV_FORMATS: dict[str, KVFormat] = {
    "auto": KVFormat(16, 16), "bf16": KVFormat(16, 16, bfloat16=True),
    "int8": KVFormat(8, 8), "k8v8": KVFormat(8, 8),
    "int4": KVFormat(4, 4), "k4v4": KVFormat(4, 4),
    "k8v4": KVFormat(8, 4), "k4v2": KVFormat(4, 2), "k2v2": KVFormat(2, 2, 32),  # KIVI's
    # per-token key scales, rotated: LeanKV's high and low tiers (each the other's halving)
    # and the mirror pair that keeps values finer than keys (a control)
    "k8v4t": KVFormat(8, 4, 32, True, True), "k4v2t": KVFormat(4, 2, 64, True, True),
    "k4v8t": KVFormat(4, 8, 32, True, True), "k2v4t": KVFormat(2, 4, 64, True, True),
}
