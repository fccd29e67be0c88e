"""The store's index: stored entries by key and by block hash, and the chains of tail entries.

An entry holds a run of a request's full blocks: a root entry blocks 0..n-1, a tail entry
blocks start..n-1 of a run whose earlier blocks its parent chain holds (a request saved as
its blocks fill: each save adds only the blocks since the last). An entry is named by the
hash of its last block, so the parent of a tail starting at block s is the entry named by
block s-1's hash. Removing an entry removes its descendants, so a block that is indexed is
always reachable from block 0: the longest stored run of a prompt is found by bisection.
Not thread-safe: the store calls it under its lock. `meta_record` / `parse_meta`: an
entry's record in the persistent tier, from which the index is rebuilt.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


class Hit(NamedTuple):
    """The longest stored run of a prompt's blocks: `blocks` blocks of entry `key` (with the
    entries it continues), which take `entry_bytes` to read and hold `blocks_bytes` for
    these blocks; `converted`: (KV format, stored bytes) of the entries among them stored
    in another form than the pool's, which a read converts (restore planning's decode cost)."""

    key: str
    blocks: int
    tier: str  # "host" or "disk": where the chain is read from (disk if any of it is)
    entry_bytes: int = 0
    blocks_bytes: int = 0
    converted: tuple[tuple[str, int], ...] = ()


@dataclass
class Entry:
    hashes: list[bytes]  # chained hashes of its own blocks
    session: str | None
    parent: str | None = None  # the entry holding the blocks before its first (a tail)
    start: int = 0  # index of its first block in the run
    # blocks from this one on (in the run; None: none) hold approximate KV (saved by a lossy
    # store from a conversation restored from a smaller form): restored marked approximate
    approx_from: int | None = None
    form: str | None = None  # the KV format it is stored in when not the pool's

    @property
    def stop(self) -> int:
        """Index one past its last block in the run."""
        return self.start + len(self.hashes)


def meta_record(model: str, session: str | None, entry: Entry) -> bytes:
    """What the persistent tier keeps beside an entry, so the index can be rebuilt."""
    head = {"model": model, "session": session, "blocks": len(entry.hashes)}
    if entry.parent is not None:
        head |= {"parent": entry.parent, "start": entry.start}
    if entry.approx_from is not None:
        head |= {"approx_from": entry.approx_from}
    if entry.form is not None:
        head |= {"form": entry.form}
    return json.dumps(head).encode() + b"\n" + b"".join(entry.hashes)


def parse_meta(data: bytes) -> tuple[str, Entry] | None:
    """(model, entry) from a meta record; None if it is not one."""
    try:
        head, _, raw = data.partition(b"\n")
        h = json.loads(head)
        n, size = int(h["blocks"]), len(raw) // max(int(h["blocks"]), 1)
        start, parent = int(h.get("start", 0)), h.get("parent")
        approx = None if h.get("approx_from") is None else int(h["approx_from"])
        form = h.get("form")
        if (not isinstance(form, str | None) or n < 1 or len(raw) != n * size
                or size not in (16, 32)
                or (parent is None) != (start == 0) or start < 0
                or (approx is not None and not start <= approx < start + n)):
            return None
        return str(h["model"]), Entry([raw[i * size:(i + 1) * size] for i in range(n)],
                                      h.get("session"), parent, start, approx, form)
    except (ValueError, KeyError, TypeError):
        return None


class EntryIndex:
    """Entries by key, block hashes to the entries holding them, parents to children."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self._where: dict[bytes, dict[str, int]] = {}  # block hash -> {key: block index}
        self._children: dict[str, set[str]] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: str) -> Entry | None:
        return self.entries.get(key)

    def add(self, key: str, entry: Entry) -> None:
        """Index `entry` under `key`; ValueError for a tail whose parent is not indexed."""
        if entry.parent is not None:
            parent = self.entries.get(entry.parent)
            if parent is None or parent.stop != entry.start:
                raise ValueError(f"tail entry {key} starts at block {entry.start}, its parent "
                                 f"{entry.parent} is not indexed or does not end there")
            self._children.setdefault(entry.parent, set()).add(key)
        self.entries[key] = entry
        for i, h in enumerate(entry.hashes):
            self._where.setdefault(h, {})[key] = entry.start + i

    def remove(self, key: str) -> list[str]:
        """Forget `key` and every entry that continues it; the keys removed, `key` first
        (none if it was not indexed)."""
        if key not in self.entries:
            return []
        removed, todo = [], [key]
        while todo:  # a long conversation's chain is long: no recursion
            k = todo.pop()
            entry = self.entries.pop(k)
            removed.append(k)
            for h in entry.hashes:
                holders = self._where.get(h)
                if holders is not None:
                    holders.pop(k, None)
                    if not holders:
                        del self._where[h]
            if entry.parent is not None and entry.parent in self._children:
                self._children[entry.parent].discard(k)
            todo += sorted(self._children.pop(k, ()), reverse=True)
        return removed

    def has_children(self, key: str) -> bool:
        return bool(self._children.get(key))

    def holders(self, h: bytes) -> dict[str, int]:
        """The entries holding block hash `h`, with its index in their run."""
        return self._where.get(h, {})

    def run(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` the index holds (chained hashes: holding
        block i means holding blocks 0..i)."""
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi) // 2
            if hashes[mid] in self._where:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def whole_run(self, hashes: Sequence[bytes]) -> int:
        """The longest prefix of `hashes` that some entry ends with (0 if none)."""
        return next((i + 1 for i in range(len(hashes) - 1, -1, -1) if any(
            self.entries[k].hashes[-1] == hashes[i] for k in self._where.get(hashes[i], ()))),
                    0)

    def chain(self, key: str) -> list[str]:
        """The keys from the root of `key`'s chain down to `key`."""
        keys = [key]
        while (parent := self.entries[keys[-1]].parent) is not None:
            keys.append(parent)
        return keys[::-1]
