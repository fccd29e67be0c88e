"""Which serving features each policy composes with, read off the policy and its layout: the
table `docs/architecture.md` shows (`tests/test_composition.py` checks the two agree and
runs every policy with the store, prefix caching and layer offload)."""

from __future__ import annotations

from jkv.kv.block_pages import BlockPages
from jkv.kv.format import KV_FORMATS
from jkv.kv.tiered_rows import TieredRows
from jkv.policies.registry import KVPolicy

HEADER = ("policy", "layout", "layer offload (LayerKV)", "KV store", "device prefix cache",
          "preemption")


def recompute_is_lossy(policy: KVPolicy) -> bool:
    """Whether KV recomputed from a sequence's tokens can differ from what it held, under
    the policy's default format (`KVCacheManager.lossy_recompute`): a row placed per prompt
    chunk, or keys scaled per page (scaled as the page grew, recomputed at once)."""
    fmt = KV_FORMATS.get(policy.default_format or "")
    return policy.token_tiers or (fmt is not None and fmt.page_keys)


def composition_rows() -> list[tuple[str, ...]]:
    """A row per registered policy, in `HEADER`'s columns."""
    from jkv.policies import POLICIES  # (this module is found while the registry is made)

    rows = []
    for policy in POLICIES.values():
        layout = TieredRows if policy.token_tiers else BlockPages
        rows.append((
            f"`{policy.name}`", f"`{layout.__name__}`",
            "layers placed while brought in for their turn" if policy.token_tiers
            else "blocks sent out as they fill",
            "whole rows, compression kept (`kv_sharing` refused: heads keep their own tokens)"
            if policy.token_tiers else "blocks, tail entries (`kv_sharing`: shared-layer form)",
            "ended rows kept whole" if policy.token_tiers else "shared full blocks",
            "only where layer offload cannot make room; what no cache or store gives back "
            "is recomputed and placed (or scaled) anew: tokens sampled before stand, later "
            "ones can differ" if recompute_is_lossy(policy)
            else "what no cache or store gives back is recomputed: the same tokens (a "
            "`kv_format` with keys scaled per page: as `kivi`)"))
    return rows


def composition_table() -> str:
    """The rows as a markdown table."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in composition_rows()]
    return "\n".join(lines)
