"""The store's side of a persistent tier whose filesystem runs out of room (`DiskRoom`, a
part `jkv.store.writes.StoreWriter` composes).

The tier fits its capacity to the filesystem (when opened, when compacted, when a write is
refused for want of space: `PersistentTier.on_full`); the placement's disk capacity follows
it, and what no longer fits is evicted by the placement's own policy, so a retried save finds
room (the tier compacts once the evictions leave room to). A full disk (or one that refuses
writes otherwise) is one event, logged once (not a traceback per save) until a disk write
succeeds again, and counted (`disk_full`, `save_failures`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from jkv.store.parts import StoreParts
from jkv.store.placement import Move

log = logging.getLogger("jkv.store.store")  # (the store's one logger)

RECHECK_S = 5.0  # how often a lowered disk budget looks for room the filesystem has again


class DiskRoom:
    """Keeps the placement's disk capacity with the tier's, and reports a full disk."""

    def __init__(self, parts: StoreParts, apply: Callable[[Sequence[Move]], bool]) -> None:
        self.p, self._apply = parts, apply
        self._capacity = 0 if parts.disk is None else parts.disk.capacity  # as followed
        self._reported = False  # the current full-disk event was logged
        self._checked = 0.0  # when `recheck` last looked

    def follow(self) -> None:
        """Move the placement's disk capacity by as much as the tier's moved since last
        seen (the room other fingerprints' entries take stays off the placement's)."""
        disk = self.p.disk
        if disk is None or disk.capacity == self._capacity:
            return
        with self.p.lock:
            placement = self.p.placement
            moves = placement.set_capacity("disk", max(0, placement.capacity["disk"]
                                                       + disk.capacity - self._capacity),
                                           self.p.queue)
        self._capacity = disk.capacity
        self._apply(moves)  # what no longer fits goes

    def recheck(self) -> None:
        """After a full disk lowered the budget, look (every `RECHECK_S` at most) for room
        freed since on the filesystem, and give it back to the placement."""
        disk, now = self.p.disk, time.monotonic()
        if disk is None or disk.capacity >= disk.configured or now - self._checked < RECHECK_S:
            return
        self._checked = now
        if disk.refit():
            log.info("the KV store's disk has room again; its budget is now %d bytes",
                     disk.capacity)
            self.follow()

    def full(self, error: Exception) -> None:
        """A disk write was refused for want of space: the tier compacts and lowers its
        capacity, the placement follows; logged once per event, counted each time."""
        before = self.p.disk.capacity
        self.p.disk.on_full()
        self.follow()
        if self.p.disk.tidy():  # the evictions made room for a compaction
            self.follow()
        after = self.p.disk.capacity
        self.p.stats.disk_full += 1
        if not self._reported:
            self._reported = True
            log.warning("the KV store's disk is full (%s); its budget is now %d bytes (was "
                        "%d) and stored entries are evicted to make room", error, after, before)

    def failed(self, error: Exception) -> None:
        """A disk write failed otherwise (unwritable, unreachable): logged once per event."""
        if not self._reported:
            self._reported = True
            log.warning("the KV store cannot write to its disk (%s); saves to it fail until "
                        "it can", error)

    def wrote(self) -> None:
        """A disk write succeeded: a full-disk event is over; the capacity a compaction
        fitted is followed."""
        self._reported = False
        self.follow()
