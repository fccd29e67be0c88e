"""What the KV store's parts share: `StoreParts` (the tiers, index, placement, counters,
rates, the lock and the saves not yet written), handed explicitly to the reader
(`loads.StoreReader`) and the writer (`writes.StoreWriter`) that `store.KVStore` composes;
and the records they exchange."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from jkv.config import StoreConfig
from jkv.store.adapt_store import AdaptStorePlacement
from jkv.store.host_tier import HostTier
from jkv.store.index import EntryIndex
from jkv.store.placement import Placement
from jkv.store.tiers import PersistentTier


@dataclasses.dataclass
class PendingSave:
    """A save queued for the writer: found by `lookup` before it is written (a preempted
    request readmitted at once), its reads waiting for `written`."""

    nbytes: int
    hashes: list[bytes]  # its own blocks'
    whole: bool
    written: threading.Event
    start: int = 0  # a tail's first block
    parent: str | None = None  # a tail's parent: the entry (written or queued) ending before


@dataclasses.dataclass
class StoreStats:
    saves: int = 0  # entries written
    saves_dropped: int = 0  # saves not stored: the writer too far behind, no room, a full disk
    save_failures: int = 0  # saves that raised (logged; the request was not affected)
    save_retries: int = 0  # saves the disk refused for want of space, retried once in room made
    disk_full: int = 0  # disk writes refused for want of space (the disk budget lowered)
    loads: int = 0  # entries read for a restore
    read_failures: int = 0  # reads that raised (a failing tier): misses, recomputed
    corrupt_entries: int = 0  # entries that failed to decode: counted, deleted, recomputed
    converted_loads: int = 0  # entries read in another KV form, converted (approximate)
    evictions: int = 0  # entries dropped from the store to make room
    offloads: int = 0  # entries moved host -> disk
    prefetches: int = 0  # entries moved disk -> host ahead of their request
    superseded: int = 0  # entries replaced by a longer one of the same prefix
    disk_resets: int = 0  # persistent tiers found damaged at open, set aside and started empty
    quarantined: int = 0  # entries whose restore failed its check: never served, deleted
    shared_entries: int = 0  # entries written in the shared-layer form (kv_sharing)
    shared_groups: int = 0  # their groups of more than one layer sharing a basis
    shared_bytes_saved: int = 0  # their bytes fewer than in the pool's format
    shared_refused: int = 0  # entries the shared form would keep poorly: the pool's format
    lossless_entries: int = 0  # entries keeping only what a split restore loads (Krul)
    lossless_bytes_saved: int = 0  # the pages they left out, recomputed on restore
    written_through: int = 0  # host-tier entries copied to a shared persistent tier
    write_through_failures: int = 0  # copies it refused (its coordinator gone, no room)


@dataclasses.dataclass(eq=False)
class StoreParts:
    """The store's shared state (see `KVStore` for what each setting means). The lock guards
    the index, the placement, `pending` and `queue`."""

    config: StoreConfig
    model: str
    kv_format: str
    page_size: int
    form: str | None  # the KV format entries are written in (None: the pool's)
    convert: Callable[[dict, str, str], dict] | None
    aligned_reads: bool
    host: HostTier
    disk: PersistentTier | None
    placement: Placement | AdaptStorePlacement
    stats: StoreStats
    max_pending_bytes: int
    index: EntryIndex = dataclasses.field(default_factory=EntryIndex)
    # measured rate of `load` (read, checksum, checks) per tier, and of converting an
    # entry of each stored KV format into the pool's (stored bytes per second), for
    # restore planning and AdaptCache's load term
    read_bytes_per_s: dict[str, float] = dataclasses.field(
        default_factory=lambda: {"host": 0.0, "disk": 0.0})
    convert_bytes_per_s: dict[str, float] = dataclasses.field(default_factory=dict)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    pending: dict[str, PendingSave] = dataclasses.field(default_factory=dict)  # by entry key
    queue: list[str] = dataclasses.field(default_factory=list)  # waiting requests' entries
    # a shared persistent tier's entries this store neither indexes nor counts (`adoption`)
    unplaced: set[str] = dataclasses.field(default_factory=set)

    @property
    def shared(self) -> bool:
        """Whether other processes write the persistent tier too (`store_coordinator`)."""
        return self.disk is not None and self.disk.coordinator is not None
    closed: bool = False
