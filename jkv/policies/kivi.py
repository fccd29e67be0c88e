"""KIVI (Liu et al.): keys quantized per channel and values per token, at 2 bits, the newest
tokens (the page being filled) in full precision. On block pages: a quantized format whose
keys share a scale per (page, channel), which is what KIVI's grouping of keys is."""

from __future__ import annotations

from jkv.policies.registry import KVPolicy, PolicySettings


def _per_channel_keys(cache: PolicySettings) -> None:
    """KIVI's keys are quantized per channel: not per token, not full precision."""
    f = cache.kv_format
    if f.token_keys or f.k_bits == 16:
        raise ValueError(f"CacheConfig.kv_format {f.name!r} is not KIVI's: kv_policy kivi "
                         "quantizes keys per channel (k2v2, k4v2, k4v4, ...)")


POLICY = KVPolicy(
    name="kivi",
    summary="keys quantized per channel and values per token (default k2v2), the page being "
            "filled in full precision (KIVI)",
    default_format="k2v2", check=_per_channel_keys)
