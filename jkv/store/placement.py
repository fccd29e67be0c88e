"""Which tier holds a conversation's KV between its turns: host memory, disk, or none.

CachedAttention section 3.3. An item is a whole session (its KV is used all together or not
at all) of some size in bytes; the host tier and disk have byte capacities that are never
exceeded. A session's KV is saved to the host tier after each of its turns; a full tier gives
up an item, the host's to disk and disk's out of the store. Which item goes is the policy:

- ``lru``: the least recently used; ``fifo``: the first placed in the tier.
- ``scheduler``: the scheduler's queue (sessions of the waiting jobs, in the order they will
  run) is a hint. Items whose job is in the look-ahead eviction window, the first
  (C_mem + C_disk) / S_kv jobs (S_kv: the mean item size), are exempt while any other item
  can go (those go least recently used first); when all are in the window, the one whose job
  runs last goes. It also prefetches: a session whose job is in the look-ahead prefetch
  window, the first C_mem / S_kv jobs, moves from disk to host before its job runs, taking
  the place of items whose jobs run later (or not at all).

Pure bookkeeping of sizes: it returns the moves, the store moves the bytes. The simulator
(`benchmarks/store_sim.py`) drives the same object the store does.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from jkv.store_config import EVICTION_POLICIES as POLICIES

TIERS = ("host", "disk")


class Move(NamedTuple):
    """Move `session`'s item from `src` to `dst` (None: not stored / dropped); with `form`
    (AdaptCache's placement only), recompressed to that KV format first."""

    session: Hashable
    src: str | None
    dst: str | None
    form: str | None = None


@dataclass
class _Item:
    size: int
    placed: int  # clock when it entered its tier (FIFO)
    used: int  # clock of its last use (LRU)


class Placement:
    """Sizes of the sessions held in host memory and on disk, and the policy that moves them.

    The store drives any placement through this interface; one that weighs more than
    sizes (AdaptCache's, `adapt_store.AdaptStorePlacement`) says so here (`lossy`,
    `weighs_recompute`) and takes the store's measures (`observe`, `set_recompute_rate`)."""

    lossy = False  # entries keep the form they were saved in
    weighs_recompute = False  # what a miss costs is no part of its choices
    recompute_token_s = 0.0

    def observe(self, read_bps: dict[str, float], decode_bps: dict[str, float]) -> None:
        """The store's measured read and conversion rates (unused by size-only policies)."""

    def set_recompute_rate(self, token_s: float) -> None:
        """Seconds a recomputed token costs (unused by size-only policies)."""

    def stats(self) -> dict:
        """What the placement adds to the store's statistics."""
        return {}

    def __init__(self, policy: str, host_bytes: int, disk_bytes: int) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        for name, value in (("host_bytes", host_bytes), ("disk_bytes", disk_bytes)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        self.policy = policy
        self.capacity = {"host": host_bytes, "disk": disk_bytes}
        self._tiers: dict[str, dict[Hashable, _Item]] = {"host": {}, "disk": {}}
        self._used = {"host": 0, "disk": 0}
        self._clock = 0

    # ------------------------------------------------------------------ queries

    def where(self, session: Hashable) -> str | None:
        """The tier holding `session`, or None."""
        for tier in TIERS:
            if session in self._tiers[tier]:
                return tier
        return None

    def size(self, session: Hashable) -> int:
        """Bytes of `session`'s item (0 when not held)."""
        tier = self.where(session)
        return 0 if tier is None else self._tiers[tier][session].size

    def bytes_used(self, tier: str) -> int:
        return self._used[tier]

    def sessions(self, tier: str) -> list[Hashable]:
        return list(self._tiers[tier])

    def by_recency(self, tier: str) -> list[Hashable]:
        """Sessions of `tier`, most recently used first."""
        items = self._tiers[tier]
        return sorted(items, key=lambda s: -items[s].used)

    def mean_item_bytes(self) -> float:
        n = len(self._tiers["host"]) + len(self._tiers["disk"])
        return (self._used["host"] + self._used["disk"]) / n if n else 0.0

    def windows(self) -> tuple[int, int]:
        """(prefetch window, eviction window) in jobs: C_mem / S_kv, (C_mem + C_disk) / S_kv."""
        s_kv = self.mean_item_bytes()
        if not s_kv:
            return 0, 0
        mem, disk = self.capacity["host"], self.capacity["disk"]
        return math.floor(mem / s_kv), math.floor((mem + disk) / s_kv)

    # ------------------------------------------------------------------ updates

    def access(self, session: Hashable, own: bool = True) -> str | None:
        """A job of `session` runs now: returns the tier its KV is read from (None: a miss).
        (`own`: whether the job's hit ends in it, or it is an entry that hit continues.)"""
        tier = self.where(session)
        if tier is not None:
            self._clock += 1
            self._tiers[tier][session].used = self._clock
        return tier

    def put(self, session: Hashable, size: int, queue: Sequence[Hashable] = (),
            keep: Collection[Hashable] = (), tokens: int = 0,
            form: str | None = None) -> list[Move]:
        """Save `session`'s KV (now `size` bytes) to host, replacing any older copy, making
        room by the policy without giving up `keep` (items it needs, e.g. the entries a
        tail continues); `queue` is the scheduler's hint. Returns the moves, this one last
        (its dst None when the item fits in neither tier). (`tokens`, `form`: the entry's
        tokens and the smaller form it is held in, AdaptCache's.)"""
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        old = self.where(session)
        placed = None
        if old is not None:
            placed = self._remove(old, session).placed
        moves: list[Move] = []
        for tier in TIERS:
            if size <= self.capacity[tier] and self._make_room(tier, size, queue, moves,
                                                               protect={session, *keep}):
                self._add(tier, session, size)
                if tier == old:  # a longer history of the same item: FIFO keeps its place
                    self._tiers[tier][session].placed = placed
                moves.append(Move(session, old, tier))
                return moves
        moves.append(Move(session, old, None))
        return moves

    def prefetch(self, queue: Sequence[Hashable]) -> list[Move]:
        """Scheduler-aware only: move sessions of the jobs in the look-ahead prefetch window
        from disk to host, in queue order, while items whose jobs run later can make room."""
        if self.policy != "scheduler":
            return []
        window, _ = self.windows()
        moves: list[Move] = []
        pos = _positions(queue)
        for session in [s for s, i in pos.items() if i < window]:
            if self.where(session) != "disk":
                continue
            size = self._tiers["disk"][session].size
            if size > self.capacity["host"]:
                continue
            if not self._make_room("host", size, queue, moves, protect={session},
                                   before=pos[session]):
                break  # later jobs would need the same room
            item = self._remove("disk", session)
            self._add("host", session, size, used=item.used)
            moves.append(Move(session, "disk", "host"))
        return moves

    def adopt(self, session: Hashable, size: int, tier: str, tokens: int = 0,
              form: str | None = None) -> bool:
        """Count an item already held in `tier` (a store reopened): False, and nothing
        counted, if it does not fit. (`tokens`, `form`: what AdaptCache's placement weighs.)"""
        if self.where(session) is not None or self._used[tier] + size > self.capacity[tier]:
            return False
        self._add(tier, session, size)
        return True

    def spill(self, session: Hashable, queue: Sequence[Hashable] = ()) -> list[Move]:
        """Move `session` from host to disk (a store closing keeps what it can), making room
        on disk by the policy; no moves if it is not in the host tier or cannot fit."""
        if self.where(session) != "host":
            return []
        size = self._tiers["host"][session].size
        moves: list[Move] = []
        if size > self.capacity["disk"] or not self._make_room("disk", size, queue, moves,
                                                              protect={session}):
            return []
        item = self._remove("host", session)
        self._add("disk", session, size, used=item.used)
        return moves + [Move(session, "host", "disk")]

    def resize(self, session: Hashable, size: int) -> list[Move]:
        """`session`'s item now takes `size` bytes where it is (recompressed smaller in
        place); its place in the order is kept. (No moves: it only shrinks.)"""
        tier = self.where(session)
        if tier is not None:
            item = self._tiers[tier][session]
            self._used[tier] += size - item.size
            item.size = size
        return []

    def set_capacity(self, tier: str, capacity: int,
                     queue: Sequence[Hashable] = ()) -> list[Move]:
        """`tier` now holds at most `capacity` bytes (its filesystem's room changed): the
        moves of the items that no longer fit, chosen by the policy (`queue`: its hint)."""
        self.capacity[tier] = capacity
        moves: list[Move] = []
        self._make_room(tier, 0, queue, moves, protect=set())
        return moves

    def drop(self, session: Hashable) -> None:
        """Forget `session` (its entry is gone: corrupt, or deleted by the store)."""
        tier = self.where(session)
        if tier is not None:
            self._remove(tier, session)

    # ------------------------------------------------------------------ internals

    def _add(self, tier: str, session: Hashable, size: int, used: int | None = None) -> None:
        self._clock += 1
        self._tiers[tier][session] = _Item(size, self._clock,
                                           self._clock if used is None else used)
        self._used[tier] += size

    def _remove(self, tier: str, session: Hashable) -> _Item:
        item = self._tiers[tier].pop(session)
        self._used[tier] -= item.size
        return item

    def _make_room(self, tier: str, size: int, queue: Sequence[Hashable], moves: list[Move],
                   protect: set, before: int | None = None) -> bool:
        """Free `size` bytes of `tier`: victims of host go to disk (when they fit), victims of
        disk are dropped. With `before`, only items whose job runs after queue position
        `before` (or never) may go. False (nothing moved) if that cannot be done."""
        free = self.capacity[tier] - self._used[tier]
        if free >= size:
            return True
        victims, freed = [], 0
        order = self._victims(tier, queue, protect, before)
        for session in order:
            victims.append(session)
            freed += self._tiers[tier][session].size
            if free + freed >= size:
                break
        else:
            return False
        for session in victims:
            item = self._remove(tier, session)
            if tier == "host" and item.size <= self.capacity["disk"] and self._make_room(
                    "disk", item.size, queue, moves, protect=protect | {session}):
                self._add("disk", session, item.size, used=item.used)
                moves.append(Move(session, "host", "disk"))
            else:
                moves.append(Move(session, tier, None))
        return True

    def _victims(self, tier: str, queue: Sequence[Hashable], protect: set,
                 before: int | None) -> list[Hashable]:
        """Items of `tier` in the order the policy gives them up."""
        items = {s: it for s, it in self._tiers[tier].items() if s not in protect}
        if self.policy == "lru":
            return sorted(items, key=lambda s: items[s].used)
        if self.policy == "fifo":
            return sorted(items, key=lambda s: items[s].placed)
        _, window = self.windows()
        pos = _positions(queue)
        never = math.inf
        outside = [s for s in items if pos.get(s, never) >= window]
        inside = [s for s in items if pos.get(s, never) < window]
        order = sorted(outside, key=lambda s: items[s].used)
        order += sorted(inside, key=lambda s: -pos[s])  # the job that runs last goes first
        if before is not None:
            order = [s for s in order if pos.get(s, never) > before]
        return order


def _positions(queue: Sequence[Hashable]) -> dict[Hashable, int]:
    """Each session's first position in the queue (its next job)."""
    pos: dict[Hashable, int] = {}
    for i, session in enumerate(queue):
        pos.setdefault(session, i)
    return pos
