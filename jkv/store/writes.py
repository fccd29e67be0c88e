"""The KV store's write side (`StoreWriter`, a part `jkv.store.store.KVStore` composes).

`save` queues a request's new blocks for the writer thread; `_write` encodes an entry (in the
store's form, or the one AdaptCache chose for it), has the placement make room and puts it in
its tier; `apply` carries out placement moves (evictions, moves between tiers, recompressions
in place); `recompress` rewrites an entry in a smaller KV form atomically (the tier's put
replaces the old bytes only once the new ones are whole). A lossy store (entries in smaller
forms) is also saved approximate blocks, marked in their entry (`Entry.approx_from`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from jkv.store.disk_room import DiskRoom
from jkv.store.entry_forms import count_shared, encode_entry
from jkv.store.fronts import drop_front
from jkv.store.host_tier import HostTier
from jkv.store.index import Entry, meta_record
from jkv.store.parts import PendingSave, StoreParts
from jkv.store.placement import Move
from jkv.store.recompress import rewrite
from jkv.store.tiers import DiskError, DiskFull, PersistentTier, TierFull

log = logging.getLogger("jkv.store.store")  # (the store's one logger)


class StoreWriter:
    """Saving, writing, moving, deleting and recompressing entries, over the store's shared
    `StoreParts`; `submit` queues a job for the store's writer thread, `reachable` says
    whether an entry (written or queued) has every entry it continues, `flush` waits for
    the queued jobs."""

    def __init__(self, parts: StoreParts, submit: Callable[[Callable[[], None]], bool],
                 reachable: Callable[[str], bool], flush: Callable[[], None]) -> None:
        self.p, self._submit, self._reachable, self.flush = parts, submit, reachable, flush
        self.room = DiskRoom(parts, self.apply)

    @property
    def keeps_approximate(self) -> bool:
        """Whether this store keeps approximate KV (a lossy store: entries in smaller forms,
        `store_kv_format` or AdaptCache's); only such a store is saved approximate blocks."""
        return self.p.form is not None or self.p.placement.lossy

    def save(self, num_blocks: int, arrays: Mapping[str, object], hashes: Sequence[bytes],
             session: str | None = None, rows: int | None = None, start: int = 0,
             exact_blocks: int | None = None, form: str | None = None,
             mark: tuple | None = None, front: np.ndarray | None = None) -> bool:
        """Queue blocks [start, num_blocks) of a request for the writer (`arrays`: host or
        device arrays with >= num_blocks - start rows, the first being block `start`, as
        `Engine.gather` returns them; a whole row's arrays with >= `rows` rows; `hashes`:
        the run's hashes from block 0). A tail (`start` > 0) continues the entry ending at
        block start - 1 (written or queued: `tail_start` says which). False (nothing queued)
        when there is nothing new (no full block, or an entry already holds these blocks) or
        a tail has no such entry. `exact_blocks`: the blocks from this one on hold approximate
        KV (`keeps_approximate` stores only; ValueError otherwise): the entry is restored
        marked approximate from there. `form`: a whole row's arrays are in this smaller
        form (a row restored from it, `SavedPages.form`; with `exact_blocks` 0): written so,
        only smaller forms after it. `mark`: (position, token, fingerprint) of the token just
        past the blocks, kept with the entry (`jkv.store.verify`). `front` [layers]: blocks
        [0, front[l]) of layer l are not kept, a split restore recomputing them
        (`jkv.store.fronts`; a root entry of block pages only, ValueError otherwise; kept
        whole by a lossy store)."""
        approx = self._approx_from(num_blocks, start, rows, exact_blocks, form, front)
        if num_blocks <= start or self.p.closed or (start and rows is not None):
            return False
        hashes = list(hashes[:num_blocks])
        key = hashes[-1].hex()
        parent = hashes[start - 1].hex() if start else None
        nbytes = sum(getattr(x, "nbytes", 0) for x in arrays.values())
        with self.p.lock:
            # a longer run of blocks serves this one; a whole row (`rows`) only its own
            held = (key in self.p.index if rows is not None
                    else bool(self.p.index.holders(hashes[-1])))
            if held or key in self.p.pending or (parent is not None
                                                and not self._reachable(parent)):
                return False
            if sum(p.nbytes for p in self.p.pending.values()) + nbytes > self.p.max_pending_bytes:
                self.p.stats.saves_dropped += 1
                return False
            pending = self.p.pending[key] = PendingSave(nbytes, hashes[start:], rows is not None,
                                                    threading.Event(), start, parent)

        def done() -> None:
            with self.p.lock:
                self.p.pending.pop(key, None)
            pending.written.set()

        def job() -> None:
            try:
                self._write(Entry(hashes[start:], session, parent, start, approx), arrays,
                            rows, form, mark, front)
            finally:
                done()

        if not self._submit(job):
            done()
            return False
        return True

    def _approx_from(self, num_blocks: int, start: int, rows: int | None,
                     exact_blocks: int | None, form: str | None,
                     front: np.ndarray | None) -> int | None:
        """`save`'s first approximate block of the run (None: none), after a ValueError for
        arguments this store cannot take."""
        approx = (None if exact_blocks is None or exact_blocks >= num_blocks
                  else max(exact_blocks, start))
        if approx is not None and not self.keeps_approximate:
            raise ValueError("exact_blocks: approximate KV is saved only to a lossy store "
                             "(store_kv_format or eviction_policy adaptcache)")
        if form is not None and (rows is None or approx != 0):
            raise ValueError("form: only a whole row restored from a smaller form "
                             "(rows, exact_blocks 0) is saved in one")
        if front is not None and (start or rows is not None):
            raise ValueError("front: only a root entry of block pages (start 0, no rows) "
                             "leaves blocks to recompute")
        return approx

    def _write(self, entry: Entry, arrays: Mapping[str, object],
               rows: int | None = None, form: str | None = None,
               mark: tuple | None = None, front: np.ndarray | None = None) -> None:
        n = len(entry.hashes)
        whole, rows = rows is not None, n if rows is None else rows
        host = {f: np.asarray(x)[:rows] for f, x in arrays.items()}  # waits for the device copy
        key = entry.hashes[-1].hex()
        src = form or self.p.kv_format  # the form the arrays are in
        fmt = src if self.p.form is None or whole else self.p.form  # (the store's own form)
        digests = np.frombuffer(b"".join(entry.hashes), np.uint8).reshape(n, -1)
        with self.p.lock:  # stored already, or its parent gone: not encoded (a slow form)
            moot = key in self.p.index or (entry.parent is not None
                                           and entry.parent not in self.p.index)
        if moot and not self._supersede(entry, key, 0, whole):  # (which counts it)
            return
        dropped = 0
        if front is not None and fmt == src and not self.keeps_approximate and np.any(front):
            host, dropped = drop_front(host, front)
        data, fmt, shared = encode_entry(self.p, host, src, fmt, n * self.p.page_size, key,
                                         digests, mark)
        self.room.recheck()  # (room a full disk has again since)
        if not self._supersede(entry, key, len(data), whole):
            return
        for retry in (False, True):  # a write the disk refused: once more, in the room made
            try:
                stored, reshared = self._place(key, entry, data, host, src, fmt, digests,
                                               form, mark)
            except DiskFull as e:
                self.room.full(e)
                if retry:
                    self.p.stats.saves_dropped += 1
                    return
                self.p.stats.save_retries += 1
                continue
            except DiskError as e:  # (not for want of room: eviction would not help)
                self.room.failed(e)
                self.p.stats.save_failures += 1
                return
            if stored:
                self._index_written(key, entry)
                if dropped:
                    self.p.stats.lossless_entries += 1
                    self.p.stats.lossless_bytes_saved += dropped
                if (reshared or shared) is not None:
                    count_shared(self.p.stats, *(reshared or shared))
            elif retry:  # the room was not made after all
                self.p.stats.saves_dropped += 1
            return

    def _place(self, key: str, entry: Entry, data: memoryview, host: Mapping[str, np.ndarray],
               src: str, fmt: str, digests: np.ndarray, form: str | None,
               mark: tuple | None = None) -> tuple[bool, tuple[int, int] | None]:
        """Have the placement make room for an encoded entry and put it in the tier it
        chose (in the smaller form chosen for it, if any): whether it was stored, and a
        shared-layer form's groups and bytes saved where it was written in one. DiskFull
        or DiskError (nothing stored) when the disk refused it."""
        n, shared = len(entry.hashes), None
        with self.p.lock:  # the entries it continues are not given up to make its room
            keep = [] if entry.parent is None or entry.parent not in self.p.index else \
                self.p.index.chain(entry.parent)
            self.p.placement.observe(self.p.read_bytes_per_s, self.p.convert_bytes_per_s)
            moves = self.p.placement.put(key, len(data), self.p.queue, keep,
                                         tokens=n * self.p.page_size, form=form)
        try:
            if not self.apply(moves[:-1]) or moves[-1].dst is None:
                with self.p.lock:
                    self.p.placement.drop(key)  # no room was made (or fits nowhere): not stored
                return False, None
            if moves[-1].form not in (None, fmt):  # written in the smaller form chosen for it
                fmt = moves[-1].form
                data, fmt, shared = encode_entry(self.p, host, src, fmt,
                                                 n * self.p.page_size, key, digests, mark)
            entry.form = None if fmt == self.p.kv_format else fmt
            with self.p.lock:  # its bytes as encoded (a form's size was an estimate)
                more = self.p.placement.resize(key, len(data))
            if not self.apply(more) or self.p.placement.where(key) != moves[-1].dst:
                with self.p.lock:
                    self.p.placement.drop(key)  # the room was not made after all
                return False, None
            self._tier(moves[-1].dst).put(key, data,
                                          meta_record(self.p.model, entry.session, entry))
        except TierFull:  # (the placement's count and the tier's disagree: not stored)
            log.warning("KV entry %s did not fit the %s tier", key, moves[-1].dst)
            with self.p.lock:
                self.p.placement.drop(key)
                self.p.stats.saves_dropped += 1
            return False, None
        except BaseException:
            with self.p.lock:
                self.p.placement.drop(key)
            raise
        if moves[-1].dst == "disk":
            self.room.wrote()
        elif self.p.shared:
            self._share(key, data, meta_record(self.p.model, entry.session, entry))
        return True, shared

    def _share(self, key: str, data: memoryview, meta: bytes) -> None:
        """Write an entry kept in this process's host tier to the shared persistent tier too,
        as a spare copy (`PersistentTier.keep_spare`), where the other processes find it. A
        copy refused (the coordinator gone, no room) is counted; the entry stays here."""
        try:
            self.p.disk.put(key, data, meta)
        except (DiskError, TierFull) as e:
            log.debug("KV entry %s not copied to the shared tier: %s", key, e)
            self.p.stats.write_through_failures += 1
            return
        self.p.disk.keep_spare(key)
        self.p.stats.written_through += 1

    def _supersede(self, entry: Entry, key: str, size: int, whole: bool) -> bool:
        """Whether `_write` goes on with an entry of `size` bytes (not stored yet, fits a
        tier, its parent still stored); if so, the shorter runs it replaces are deleted
        before the placement makes its room."""
        with self.p.lock:
            if key in self.p.index:
                return False  # already stored
            if size > max(self.p.placement.capacity.values()):
                self.p.stats.saves_dropped += 1  # fits no tier (the shorter runs stay)
                return False
            if entry.parent is not None and entry.parent not in self.p.index:
                self.p.stats.saves_dropped += 1  # its parent was evicted meanwhile: unreachable
                return False
            # a longer run of blocks replaces shorter ones nothing continues (a tail's
            # ancestors stay); whole rows are used whole only
            older = [] if whole or entry.parent is not None else [
                h.hex() for h in entry.hashes[:-1]
                if h.hex() in self.p.index and not self.p.index.has_children(h.hex())]
        for old in older:  # a longer run of the same prefix replaces them
            self.delete(old)
            self.p.stats.superseded += 1
        return True

    def _index_written(self, key: str, entry: Entry) -> None:
        """A written entry into the index, unless the room made for it evicted its parent
        (then it is unreachable: deleted)."""
        with self.p.lock:
            orphan = entry.parent is not None and entry.parent not in self.p.index
            if not orphan:
                self.p.index.add(key, entry)
        if orphan:
            self.p.stats.saves_dropped += 1
            self.delete(key)
            return
        self.p.stats.saves += 1

    def _tier(self, name: str) -> HostTier | PersistentTier:
        return self.p.host if name == "host" else self.p.disk

    def _stored_in(self, key: str, first: str) -> str | None:
        """The tier holding `key`'s bytes (`first` looked in first); None when none does."""
        for name in (first, "host", "disk"):
            tier = self._tier(name)
            if tier is not None and key in tier:
                return name
        return None

    def apply(self, moves: Sequence[Move]) -> bool:
        """Carry out placement moves of stored entries (in order: each makes the room the
        next needs). False if one failed (that entry is then deleted)."""
        ok = True
        for m in moves:
            if m.dst is None:
                self.delete(m.session)
                self.p.stats.evictions += 1
                continue
            with self.p.lock:
                gone = m.session not in self.p.index  # went with an entry it continued
            # where its bytes are now: moves carried out in between (a resize's) may have
            # moved it already
            at = None if gone else self._stored_in(m.session, m.src)
            if at is None:
                continue
            m = m._replace(src=at)
            done = None if m.form is None else self._recompress(m.session, m.src, m.form)
            if done is False:
                log.warning("could not recompress KV entry %s to %s", m.session, m.form)
                self.delete(m.session)
                ok = False
                continue
            if m.form is not None and done is None:
                # its bytes stay: counted as they are (the placement keeps the form it
                # chose, a smaller one: its quality then errs low)
                with self.p.lock:
                    more = self.p.placement.resize(m.session, self._tier(m.src).size(m.session))
                ok = self.apply(more) and ok
            if m.form is not None:  # (the moves its resize carried out may have moved it)
                at = self._stored_in(m.session, m.src)
                if at is None:
                    continue
                m = m._replace(src=at)
            if m.src != m.dst and not self._move(m):
                ok = False
        return ok

    def _move(self, m: Move) -> bool:
        """Move an entry's bytes between tiers: False if that failed (it is then deleted).
        An entry promoted from disk keeps its disk copy (a spare: a process that dies
        before the host tier gives it back still finds it there), which an entry going
        back to disk becomes again instead of being written."""
        src, dst, disk = self._tier(m.src), self._tier(m.dst), self.p.disk
        if m.dst == "disk" and disk.is_spare(m.session):
            disk.claim(m.session)
        else:
            data, meta = src.get(m.session), src.meta(m.session)
            try:
                if data is None:
                    raise KeyError(f"entry {m.session} vanished from the {m.src} tier")
                dst.put(m.session, data, meta or b"")
            except Exception as e:  # an I/O error of the tier as much as TierFull
                if isinstance(e, DiskFull):
                    self.room.full(e)  # (logged there, once)
                elif isinstance(e, DiskError):
                    self.room.failed(e)
                else:
                    log.warning("could not move KV entry %s %s -> %s: %s", m.session, m.src,
                                m.dst, e)
                self.delete(m.session)
                return False
        if m.dst == "disk":
            src.delete(m.session)
            self.room.wrote()
            self.p.stats.offloads += 1
        else:
            disk.keep_spare(m.session)
            self.p.stats.prefetches += 1
        return True

    def delete(self, key: str) -> None:
        """Forget an entry and every entry that continues it, and delete their bytes from
        every tier."""
        with self.p.lock:
            keys = self.p.index.remove(key) or [key]
            for k in keys:
                self.p.placement.drop(k)
        for k in keys:
            for tier in (self.p.host, self.p.disk):
                if tier is not None and k in tier:
                    tier.delete(k)

    def clear(self) -> None:
        """Delete every entry of this store's KV (other fingerprints' are left alone)."""

        def clear_all() -> None:
            with self.p.lock:
                keys = list(self.p.index.entries)
            for key in keys:
                self.delete(key)

        self._submit(clear_all)
        self.flush()

    def recompress(self, key: str, kv_format: str) -> bool:
        """Rewrite entry `key` in place (its tier, its key) in the smaller KV form
        `kv_format`: its restores then read that form, converted into the pool's and marked
        approximate. A tier's put replaces the old bytes only once the new ones are whole,
        so a failure midway leaves the old entry as it was. False, nothing changed, when
        the entry is gone, still being saved, unreadable, already in that form, would not
        get smaller, or its tier failed. Runs where moves run (the writer thread), or with
        the store idle."""
        with self.p.lock:
            if (self.p.convert is None or key not in self.p.index or key in self.p.pending
                    or self.p.placement.where(key) is None):
                return False
            tier = self.p.placement.where(key)
        return self._recompress(key, tier, kv_format) is True

    def _recompress(self, key: str, tier: str, kv_format: str) -> bool | None:
        """`recompress` of the entry the `tier` tier holds (`recompress.rewrite`)."""
        return rewrite(self.p, self._tier(tier), key, tier, kv_format, self.apply)
