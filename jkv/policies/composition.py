"""Which serving features each policy composes with, read off the policy and its layout: the
table `docs/architecture.md` shows (`tests/test_composition.py` checks the two agree and
runs every policy with the store, prefix caching and layer offload)."""

from __future__ import annotations

from jkv.kv.block_pages import BlockPages
from jkv.kv.tiered_rows import TieredRows

HEADER = ("policy", "layout", "layer offload (LayerKV)", "KV store", "device prefix cache",
          "preemption")


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
            "whole rows, compression kept" if policy.token_tiers else "blocks, tail entries",
            "ended rows kept whole" if policy.token_tiers else "shared full blocks",
            "where offload cannot make room; resumes from its kept or stored row (last "
            "partial page recomputed), else placed anew" if policy.token_tiers
            else "resumes from cached or stored blocks, else recomputes (KIVI's per-page "
            "key scales anew)"))
    return rows


def composition_table() -> str:
    """The rows as a markdown table."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in composition_rows()]
    return "\n".join(lines)
