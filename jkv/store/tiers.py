"""Where entry bytes live past the process: the persistent tier, a tensorstore kvstore (host
memory is `jkv.store.host_tier`).

Both tiers hold opaque entry bytes (`jkv.store.codec`) under string keys, count their bytes
and refuse a write past their capacity (`TierFull`); the store decides what to evict
(`jkv.store.placement`) before it writes.

The persistent tier is a tensorstore kvstore wrapped in the OCDBT driver, so every write is
an atomic commit: a process killed mid-write leaves the previous state. Its index is rebuilt
from the listing when it opens: an entry's size is part of its stored name, `<key>@<bytes>`,
so opening reads no entry. A long entry is stored as values of `PART` bytes (`<key>@<bytes>`,
`<key>@<bytes>.1`, ...) committed together, so no one conversion between Python bytes and
tensorstore holds the GIL for long (other names are left alone). An entry may carry a small
`meta` record (its block hashes), committed with it as `<key>@<bytes>.meta`, read back in one
batch by `metas()`, not counted against the capacity. A database found damaged when it opens
(a manifest or b-tree node that does not decode, or a data file cut short) is started empty
(`damaged`): a bad disk costs recomputation, never a failed start; in a directory its files
are first moved to a dated sibling folder (`set_aside_to`), elsewhere deleted.

Several processes may write one database at once through tensorstore's OCDBT coordinator
(`coordinator`: the address of a `ts.ocdbt.DistributedCoordinatorServer`): commits stay
atomic, `sync` takes up the others' entries and deletions; such a database is never
compacted nor reset by one of them (a damaged one is an error at open).

In a directory the tier minds its filesystem (`ocdbt_files.LocalDatabase`: its capacity
fitted to the space there, compactions giving deleted entries' bytes back). A write refused
for want of space is `DiskFull`: `on_full` compacts and lowers the capacity, `refit` raises
it again once the filesystem has room. A spare entry (`keep_spare`) is a copy kept on disk of
one the store holds in host memory: not the store's to count, deleted first when its room is
needed.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np
import tensorstore as ts

from jkv.store import ocdbt_files as files
from jkv.store.codec import aligned_buffer
from jkv.store.stored_names import check_key, part_name, part_sizes, read_listing

log = logging.getLogger(__name__)



class TierFull(ValueError):
    """A write that would take the tier past its capacity."""


class DiskError(RuntimeError):
    """A write the persistent tier's storage refused (nothing changed)."""


class DiskFull(DiskError):
    """A write the persistent tier's storage refused for want of space."""


class PersistentTier:
    """Entries in a tensorstore kvstore through OCDBT (atomic commits), at most `capacity`
    bytes. `spec`: a local directory, or any tensorstore kvstore spec (a dict or a URL such
    as ``s3://bucket/prefix/``) to put the OCDBT database in. In a directory, `free_space`
    says how many more bytes its files may take on their filesystem (default: what it has
    free, less a margin: `ocdbt_files.space_probe`); `capacity` is then at most a third of
    that plus what the files take (the module docstring says why)."""

    name = "disk"

    def __init__(self, spec: str | os.PathLike | dict, capacity: int,
                 free_space: Callable[[], int] | None = None,
                 coordinator: str | None = None) -> None:
        if capacity < 0:
            raise ValueError(f"disk capacity must be >= 0 bytes, got {capacity}")
        self.configured = self.capacity = capacity
        self.coordinator = coordinator  # several writers share the database through it
        self.path: Path | None = None  # the directory, when the tier is in one
        self._db: files.LocalDatabase | None = None
        if isinstance(spec, (str, os.PathLike)) and "://" not in str(spec):
            self.path = Path(spec).expanduser().resolve()
            self._db = files.LocalDatabase(self.path, free_space)
            self._base: dict | str = {"driver": "file", "path": f"{self.path}/"}
        else:
            self._base = spec
        self._lock = threading.Lock() if self._db is None else self._db.lock
        self.damaged = False  # the database was unreadable at open and was started again
        self.set_aside_to: Path | None = None  # where its damaged files were moved
        self._index_names(self._open_or_start_again(spec))
        self._spares: dict[str, None] = {}  # copies of entries held in host memory
        if self._db is not None:
            self._db.measure()
            self.capacity = self._db.fit(capacity)
            if self.capacity < capacity:
                log.info("the KV store at %s holds at most %d bytes (not %d): a third of the "
                         "room its filesystem has for it", self.path, self.capacity, capacity)

    def _open_or_start_again(self, spec: str | os.PathLike | dict) -> list[str]:
        """The stored names of the database, opened; a damaged one is set aside (deleted
        where it is not in a directory) and started empty."""
        try:
            return self._open()
        except (ValueError, RuntimeError) as e:
            if not files.damaged(e):  # unreachable, refused, misconfigured: say so
                raise ValueError(f"cannot open the KV store at {spec!r}: {e}") from e
            if self.coordinator is not None:  # others write it: not this process's to reset
                raise ValueError(f"the shared KV store at {spec!r} is damaged ({e}); stop "
                                 "its writers and move it aside, or give another") from e
            self.damaged = True
            if self.path is None:
                log.warning("the KV store at %r is damaged (%s); its entries are deleted and "
                            "it starts empty", spec, e)
                return self._reset()
            self.set_aside_to = files.set_aside(self.path)
            log.warning("the KV store at %s is damaged (%s); its files were moved to %s and "
                        "it starts empty", self.path, e, self.set_aside_to)
            return self._open()

    def _index_names(self, names: list[str]) -> None:
        """Entries (key, stored name, size), meta records and foreign names from a listing."""
        got = read_listing(names, lambda size: len(part_sizes(size)))
        self._names, self._sizes, self._has_meta = got.names, got.sizes, got.has_meta
        self.bytes_used, self.foreign = got.bytes_used, got.foreign

    def _open(self) -> list[str]:
        self._kv = files.open_db(self._base, self.coordinator)
        return self._list()

    def _list(self) -> list[str]:
        with self._lock:
            return [n.decode() for n in self._kv.list().result()]

    def sync(self) -> tuple[list[str], list[str]]:
        """Take up what the database's other writers (`coordinator`) changed: its listing
        read again; the keys of the entries it holds that this tier did not hold (or held
        under another name: written again) and of those it held that are gone (another
        writer deleted them). Runs where writes run (the store's writer thread)."""
        got = read_listing(self._list(), lambda size: len(part_sizes(size)))
        got.drop_unrecorded(keep=self._names)  # being written: its record comes last
        new = [k for k, n in got.names.items() if self._names.get(k) != n]
        gone = [k for k in self._names if k not in got.names]
        for key in gone:
            self._spares.pop(key, None)
        self._names, self._sizes, self._has_meta = got.names, got.sizes, got.has_meta
        self.bytes_used, self.foreign = got.bytes_used, got.foreign
        return new, gone

    def _reset(self) -> list[str]:
        """Delete the OCDBT database's own files (its manifest and data files under ``d/``),
        nothing else under its base, and open it again, empty (a miss for each entry)."""
        raw = ts.KvStore.open(self._base).result()
        raw.delete_range(ts.KvStore.KeyRange("d/", "d0")).result()
        raw.delete_range(ts.KvStore.KeyRange("manifest.ocdbt", "manifest.ocdbt\0")).result()
        return self._open()

    # ------------------------------------------------------------------ room on the filesystem

    compactions = property(lambda self: 0 if self._db is None else self._db.compactions)

    def compact(self) -> bool:
        """Compact the database (in a directory: `ocdbt_files.LocalDatabase.compact`), then
        fit the capacity to the filesystem again; False when nothing changed."""
        if (self._db is None or self.coordinator is not None  # (others hold the files open)
                or not self._db.compact(self._kv, self._stored(), self._install)):
            return False
        self.capacity = self._db.fit(self.configured)
        self._drop_spares(self.bytes_used - self.capacity, keep="")
        return True

    def _install(self, kv: ts.KvStore) -> None:
        self._kv = kv

    def _stored(self) -> list[str]:
        """Every stored name: the entries' values and meta records, and the foreign ones."""
        out = list(self.foreign)
        for key, name in self._names.items():
            out += [part_name(name, i) for i in range(len(part_sizes(self._sizes[key])))]
            out += [f"{name}.meta"] if name in self._has_meta else []
        return out

    def tidy(self) -> bool:
        """Compact when deleted entries' bytes take room and the copy fits beside them."""
        if self._db is None:
            return False
        self._db.measure()  # (with what a failed write left)
        deleted = self._db.footprint - self.bytes_used
        return deleted > 0 and self._db.free_space() >= self.bytes_used and self.compact()

    def refit(self) -> bool:
        """Raise a capacity `on_full` lowered as far as the filesystem allows now: whether
        it rose."""
        before = self.capacity
        if self._db is not None and before < self.configured:
            self._db.measure()
            self.capacity = max(before, self._db.fit(self.configured))
        return self.capacity > before

    def on_full(self) -> int:
        """After `DiskFull`: drop the spare copies, compact if that fits, and lower the
        capacity to fit the filesystem (while a compaction does not fit, to half the room
        left, so that evictions make room for one); the new capacity."""
        for key in list(self._spares):
            self.delete(key)
        if self._db is not None:
            self.tidy()
            free, capacity = self._db.free_space(), self._db.fit(self.capacity)
            if self._db.footprint > self.bytes_used and free < self.bytes_used:
                capacity = min(capacity, free // 2)
            self.capacity = capacity
        return self.capacity

    # ------------------------------------------------------------------ spare copies

    def keep_spare(self, key: str) -> None:
        """Keep `key`'s bytes as a spare copy of an entry the store now holds elsewhere."""
        if key in self._names:
            self._spares[key] = None

    def is_spare(self, key: str) -> bool:
        return key in self._spares

    @property
    def spare_bytes(self) -> int:
        return sum(self._sizes[k] for k in self._spares)

    def claim(self, key: str) -> None:
        """`key`'s spare copy is the store's entry again (the one elsewhere leaves)."""
        self._spares.pop(key, None)

    def _drop_spares(self, over: int, keep: str) -> None:
        """Delete spare copies, oldest first, until `over` bytes are freed."""
        for key in list(self._spares):
            if over <= 0:
                return
            if key != keep:
                over -= self._sizes[key]
                self.delete(key)

    def __contains__(self, key: str) -> bool:
        return key in self._names

    def keys(self) -> list[str]:
        return list(self._names)

    def size(self, key: str) -> int:
        return self._sizes[key]

    def put(self, key: str, data: bytes | memoryview, meta: bytes = b"") -> None:
        """Store `key` (replacing it atomically); spare copies make way first. TierFull past
        the capacity; DiskFull when the storage is out of space, DiskError when it refused
        otherwise (nothing changed)."""
        check_key(key)
        old = self._sizes.get(key, 0)
        self._drop_spares(self.bytes_used - old + len(data) - self.capacity, keep=key)
        if self.bytes_used - old + len(data) > self.capacity:
            raise TierFull(f"disk tier: {len(data)} more bytes would exceed its capacity of "
                           f"{self.capacity} ({self.bytes_used} used)")
        if self._db is not None and self._db.wants_compaction(self.bytes_used, len(data),
                                                              self.capacity):
            self.compact()  # (never with several writers)
        name = f"{key}@{len(data)}"
        try:
            self._commit(key, name, data, meta)
        except (ValueError, RuntimeError) as e:
            if files.out_of_space(e):
                raise DiskFull(f"disk tier: no space for {len(data)} bytes: {e}") from e
            raise DiskError(f"disk tier: cannot write {len(data)} bytes: {e}") from e
        self._has_meta.discard(self._names.get(key))
        if meta:
            self._has_meta.add(name)
        self._names[key], self._sizes[key] = name, len(data)
        self.bytes_used += len(data) - old
        if self._db is not None:
            self._db.footprint += len(data) + len(meta)
        self._spares.pop(key, None)

    def _commit(self, key: str, name: str, data: bytes | memoryview, meta: bytes) -> None:
        """Write an entry's values (and meta record) under `name`, its old ones removed, in
        one atomic commit; in a shared database (whose coordinator commits one name at a
        time) its values first, then its meta record, which makes it an entry to the others
        (`sync`), then its old names' removal."""
        if self.coordinator is not None:
            self._commit_shared(key, name, data, meta)
            return
        txn = ts.Transaction(atomic=True)  # the new names and the old ones' removal together
        kv = self._kv.with_transaction(txn)
        if key in self._names:
            self._delete_name(self._names[key], txn)
        view, at = memoryview(data).cast("B"), 0
        for i, n in enumerate(part_sizes(len(view))):  # one commit makes them all visible
            kv.write(part_name(name, i), bytes(view[at:at + n])).result()  # it takes bytes only
            at += n
        if meta:
            kv.write(f"{name}.meta", bytes(meta)).result()
        txn.commit_async().result()

    def _commit_shared(self, key: str, name: str, data: bytes | memoryview,
                       meta: bytes) -> None:
        view, at, writes = memoryview(data).cast("B"), 0, []
        for i, n in enumerate(part_sizes(len(view))):
            writes.append(self._kv.write(part_name(name, i), bytes(view[at:at + n])))
            at += n
        for w in writes:
            w.result()
        if meta:
            self._kv.write(f"{name}.meta", bytes(meta)).result()
        old = self._names.get(key)
        if old is not None and old != name:
            self._delete_name(old)

    def _read(self, name: str) -> bytes | None:
        try:
            with self._lock:
                r = self._kv.read(name).result()
        except (ValueError, RuntimeError):
            return None
        return bytes(r.value) if r.state == "value" else None

    def meta(self, key: str) -> bytes | None:
        name = self._names.get(key)
        return None if name not in self._has_meta else self._read(f"{name}.meta")

    def metas(self, keys: Collection[str] | None = None) -> dict[str, bytes]:
        """The meta records of `keys` (default: every entry), read in one batch of concurrent
        reads (entries without one, or whose record cannot be read, are left out)."""
        out = {}
        names = self._names if keys is None else {k: self._names[k] for k in keys
                                                   if k in self._names}
        with self._lock:
            futures = {k: self._kv.read(f"{n}.meta") for k, n in names.items()
                       if n in self._has_meta}
            for key, future in futures.items():
                try:
                    r = future.result()
                except (ValueError, RuntimeError):
                    continue
                if r.state == "value":
                    out[key] = bytes(r.value)
        return out

    def get(self, key: str) -> memoryview | None:
        """The stored bytes (read-only, 64-byte aligned), or None when absent or unreadable
        (a damaged store). An entry is stored as values of `PART` bytes and read into one
        buffer: tensorstore converts a value to Python bytes (and bytes to a value) holding
        the GIL, so a single value of a long entry stopped the serving loop's thread for as
        long as a whole conversion; a part holds it only briefly."""
        name = self._names.get(key)
        if name is None:
            return None
        sizes = part_sizes(int(name.rsplit("@", 1)[1]))  # (a `sync` may drop the key now)
        out = aligned_buffer(sum(sizes))
        try:
            with self._lock:  # (a compaction swaps the files only between reads)
                reads = [self._kv.read(part_name(name, i)) for i in range(len(sizes))]
                at = 0
                for future, size in zip(reads, sizes, strict=True):
                    r = future.result()
                    if r.state != "value" or len(r.value) != size:
                        return None
                    out[at:at + size] = np.frombuffer(r.value, np.uint8)
                    at += size
        except (ValueError, RuntimeError):
            return None
        out.flags.writeable = False
        return memoryview(out)

    def delete(self, key: str) -> None:
        """Forget `key` and delete its values; where the storage refuses (a full disk: a
        deletion is a commit too) they stay, unlisted, until a compaction leaves them out."""
        name = self._names.pop(key, None)
        self._spares.pop(key, None)
        if name is not None:
            self.bytes_used -= self._sizes.pop(key)
            self._has_meta.discard(name)
            try:
                self._delete_name(name)
            except (ValueError, RuntimeError) as e:
                log.debug("could not delete KV entry %s: %s", key, e)

    def _delete_name(self, name: str, txn: ts.Transaction | None = None) -> None:
        """Delete an entry's values and its meta record (one range: name, name.1, ...,
        name.meta)."""
        kv = self._kv if txn is None else self._kv.with_transaction(txn)
        kv.delete_range(ts.KvStore.KeyRange(name, name + ".meta\0")).result()
