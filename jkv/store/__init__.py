"""Host and persistent KV tiers: entry codec, DRAM and tensorstore tiers, placement."""

from jkv.store.placement import POLICIES, TIERS, Move, Placement

__all__ = ["POLICIES", "TIERS", "Move", "Placement"]
