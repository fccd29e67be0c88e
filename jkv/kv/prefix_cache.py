"""Which full pages on the device hold which token prefixes (the device prefix cache).

A *block* is `page_size` tokens of one sequence: one page for every (layer, KV head). Blocks
are keyed by chained hashes (the hash of a block's token ids and of the block before it,
seeded with the model, the KV format and the page size), so two requests that share a
prefix share its blocks whatever else they say. This module is the host-side index: block
rows, reference counts and LRU order. The page ids themselves sit on the device in a
[rows, layers, heads] array owned by the KV cache manager (`jkv.kv.manager`).

A row with no reference is *evictable*: its pages count as free for admission and are
returned to the pool, least recently used first, when pages run short or when the cache
outgrows its byte budget.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def block_hashes(token_ids: Sequence[int], page_size: int, seed: bytes,
                 num_blocks: int | None = None) -> list[bytes]:
    """Chained hashes of the first `num_blocks` full blocks of `token_ids` (all by default)."""
    full = len(token_ids) // page_size
    n = full if num_blocks is None else min(num_blocks, full)
    ids = np.asarray(token_ids[: n * page_size], np.int64)
    out, prev = [], hashlib.blake2b(seed, digest_size=16).digest()
    for i in range(n):
        prev = hashlib.blake2b(prev + ids[i * page_size:(i + 1) * page_size].tobytes(),
                               digest_size=16).digest()
        out.append(prev)
    return out


@dataclass
class _Row:
    key: bytes
    depth: int  # block index within its sequence: deeper blocks go first among equals
    refs: int = 0
    last_used: int = 0


class PrefixCache:
    """Index of `capacity` block rows; at most `max_rows` of them hold blocks at a time."""

    def __init__(self, capacity: int, max_rows: int | None = None) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.max_rows = capacity if max_rows is None else min(max_rows, capacity)
        self._rows: dict[int, _Row] = {}
        self._by_key: dict[bytes, int] = {}
        self._spare = list(range(capacity - 1, -1, -1))
        self._clock = 0
        # eviction candidates (last_used, -depth, row), stale entries skipped when popped:
        # every operation stays O(log n) however many blocks the cache holds
        self._heap: list[tuple[int, int, int]] = []
        self._num_unreferenced = 0

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def num_evictable(self) -> int:
        return self._num_unreferenced

    def num_unreferenced(self, rows: Sequence[int]) -> int:
        return sum(1 for r in rows if self._rows[r].refs == 0)

    def num_sole(self, rows: Sequence[int]) -> int:
        """Rows held by exactly one reference (they become evictable when it goes)."""
        return sum(1 for r in rows if self._rows[r].refs == 1)

    def holds(self, row: int) -> bool:
        """Whether `row` holds a block (it may have been evicted since it was looked up)."""
        return row in self._rows

    def touch(self, rows: Sequence[int]) -> None:
        """Rows used together get one age, so eviction takes their deepest block first."""
        self._clock += 1
        for r in rows:
            row = self._rows[r]
            row.last_used = self._clock
            if row.refs == 0:
                heapq.heappush(self._heap, (self._clock, -row.depth, r))
        if len(self._heap) > 2 * len(self._rows) + 64:  # drop the stale entries
            self._heap = [(x.last_used, -x.depth, i) for i, x in self._rows.items()
                          if x.refs == 0]
            heapq.heapify(self._heap)

    def keys(self) -> list[bytes]:
        """The block hashes the cache holds (one C-level copy: safe beside its writer)."""
        return list(self._by_key)

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Rows of the longest run of `keys`, from the first, that the cache holds."""
        rows = []
        for k in keys:
            row = self._by_key.get(k)
            if row is None:
                break
            rows.append(row)
        return rows

    def acquire(self, rows: Sequence[int]) -> None:
        """A sequence now reads these rows: they cannot be evicted until released."""
        for r in rows:
            self._num_unreferenced -= self._rows[r].refs == 0
            self._rows[r].refs += 1
        self.touch(rows)

    def release(self, rows: Sequence[int]) -> None:
        for r in rows:
            if self._rows[r].refs <= 0:
                raise ValueError(f"row {r} released more often than acquired")
        for r in rows:
            self._rows[r].refs -= 1
            self._num_unreferenced += self._rows[r].refs == 0
        self.touch(rows)

    def eviction_order(self) -> list[int]:
        """Unreferenced rows, least recently used first, deeper blocks first on ties."""
        free = [(r.last_used, -r.depth, i) for i, r in self._rows.items() if r.refs == 0]
        return [i for _, _, i in sorted(free)]

    def evict(self, n: int) -> list[int]:
        """Drop up to `n` unreferenced rows (LRU); returns them so their pages can be freed."""
        out = []
        while len(out) < n and self._heap:
            last_used, _, i = heapq.heappop(self._heap)
            row = self._rows.get(i)
            if row is None or row.refs or row.last_used != last_used:
                continue  # stale: evicted, referenced or touched since
            del self._by_key[self._rows.pop(i).key]
            self._spare.append(i)
            self._num_unreferenced -= 1
            out.append(i)
        return out

    def insert(self, key: bytes, depth: int) -> tuple[int | None, list[int]]:
        """Give a new block a row, unreferenced. Returns (row, rows evicted to make room);
        row is None when the key is already held or no room can be made."""
        if key in self._by_key or self.max_rows == 0:
            return None, []
        evicted = []
        if len(self._rows) >= self.max_rows or not self._spare:
            evicted = self.evict(1)
            if not evicted:
                return None, []
        row = self._spare.pop()
        self._rows[row] = _Row(key, depth)
        self._by_key[key] = row
        self._num_unreferenced += 1
        self.touch([row])
        return row, evicted
