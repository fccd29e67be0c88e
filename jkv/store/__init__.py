"""Host and persistent KV tiers: entry codec, DRAM and tensorstore tiers, placement."""

from jkv.store.codec import CorruptEntry, EntryInfo, EntryMismatch, decode, encode
from jkv.store.placement import POLICIES, TIERS, Move, Placement
from jkv.store.tiers import HostTier, PersistentTier, TierFull

__all__ = ["POLICIES", "TIERS", "CorruptEntry", "EntryInfo", "EntryMismatch", "HostTier",
           "Move", "PersistentTier", "Placement", "TierFull", "decode", "encode"]
