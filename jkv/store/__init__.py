"""Host and persistent KV tiers: entry codec, host-memory and tensorstore tiers, placement, and the
store that puts them together."""

from jkv.store.codec import CorruptEntry, EntryInfo, EntryMismatch, decode, encode
from jkv.store.host_tier import HostTier
from jkv.store.placement import POLICIES, TIERS, Move, Placement
from jkv.store.store import Hit, KVStore
from jkv.store.tiers import PersistentTier, TierFull

__all__ = ["POLICIES", "TIERS", "CorruptEntry", "EntryInfo", "EntryMismatch", "Hit",
           "HostTier", "KVStore", "Move", "PersistentTier", "Placement", "TierFull", "decode",
           "encode"]
