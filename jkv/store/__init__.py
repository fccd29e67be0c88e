"""Host and persistent KV tiers: entry codec, DRAM and tensorstore tiers, placement."""

from jkv.store.codec import CorruptEntry, EntryInfo, EntryMismatch, decode, encode
from jkv.store.placement import POLICIES, TIERS, Move, Placement

__all__ = ["POLICIES", "TIERS", "CorruptEntry", "EntryInfo", "EntryMismatch", "Move",
           "Placement", "decode", "encode"]
