"""Entries the store finds in its persistent tier rather than writes: those there when it opens,
and, where several processes write one tier (`StoreConfig.store_coordinator`), those the
others wrote or deleted since (`sync_shared`, on the store's writer thread every
`REFRESH_S` seconds, `KVStore.refresh`).

An entry of this KV (its meta record names this model and its last block's hash) whose chain
is whole is indexed; the others' bytes are counted against the capacity and evicted like any
other entry (another model's, an unreadable record). At opening a tail whose parent is gone, or
an entry past the capacity, is deleted; in a shared tier it is left to its writer (another
process may still use it) and never looked at again (`StoreParts.unplaced`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection

from jkv.store.adapt_store import FOREIGN
from jkv.store.index import Entry, parse_meta
from jkv.store.parts import StoreParts

REFRESH_S = 1.0  # seconds between looks at what a shared tier's other writers changed


def adopt(p: StoreParts, keys: Collection[str], opening: bool,
          set_capacity: Callable[[int], None]) -> None:
    """Index (or count, or delete: see the module docstring) the persistent tier's entries
    `keys`, parents first. `set_capacity` lowers the tier's budget past entries found at
    opening that are not ours and do not fit (never deleted: their room is not ours to
    use). Not under the store's lock."""
    disk = p.disk
    metas = disk.metas(keys)
    ours, other = [], []
    for key in keys:
        parsed = parse_meta(metas.get(key, b""))
        if parsed is not None and parsed[0] == p.model and parsed[1].hashes[-1].hex() == key:
            ours.append((key, parsed[1]))
        else:
            other.append(key)
    with p.lock:
        drop = [key for key, entry in sorted(ours, key=lambda x: x[1].start)  # parents first
                if not _adopt_ours(p, key, entry)]
        unfit = [key for key in other
                 if not p.placement.adopt(key, disk.size(key), "disk", form=FOREIGN)]
        if not opening or p.shared:  # others may still use them
            p.unplaced.update(drop + unfit)
            return
    for key in drop:
        disk.delete(key)
    for key in unfit:
        set_capacity(max(0, p.placement.capacity["disk"] - disk.size(key)))


def _adopt_ours(p: StoreParts, key: str, entry: Entry) -> bool:
    """Index one entry of this KV (under the lock): False when its chain is broken (a tail
    whose parent is gone) or it does not fit."""
    parent = None if entry.parent is None else p.index.get(entry.parent)
    if entry.parent is not None and (parent is None or parent.stop != entry.start):
        return False
    if not p.placement.adopt(key, p.disk.size(key), "disk", len(entry.hashes) * p.page_size,
                             entry.form):
        return False
    p.index.add(key, entry)
    return True


def sync_shared(p: StoreParts, delete: Callable[[str], None],
                set_capacity: Callable[[int], None]) -> None:
    """Take up what a shared tier's other writers changed (`PersistentTier.sync`): entries
    they deleted are forgotten with what continues them (a copy in this process's host tier
    stays: it is whole), entries they wrote adopted."""
    new, gone = p.disk.sync()
    with p.lock:
        gone = [k for k in gone if p.placement.where(k) == "disk"]
        p.unplaced.difference_update(gone)
    for key in gone:
        delete(key)
    with p.lock:
        new = [k for k in new if p.placement.where(k) is None and k not in p.unplaced]
    if new:
        adopt(p, new, opening=False, set_capacity=set_capacity)


class Refresher:
    """Queues `job` for the store's writer every `interval` seconds (one at a time: none is
    queued while the last has not run) until `stop`."""

    def __init__(self, submit: Callable[[Callable[[], None]], bool], job: Callable[[], None],
                 interval: float = REFRESH_S) -> None:
        self._submit, self._job, self._interval = submit, job, interval
        self._idle = threading.Event()
        self._idle.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jkv-store-refresh",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            if self._idle.is_set():
                self._idle.clear()
                if not self._submit(self._once):
                    return

    def _once(self) -> None:
        try:
            self._job()
        finally:
            self._idle.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
