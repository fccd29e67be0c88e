"""Where entry bytes live: host memory and a persistent tensorstore kvstore.

Both tiers hold opaque entry bytes (`jkv.store.codec`) under string keys, count their bytes
and refuse a write past their capacity (`TierFull`): the capacity is enforced here, and the
store decides what to evict (`jkv.store.placement`) before it writes.

The persistent tier is a tensorstore kvstore wrapped in the OCDBT driver, so every write is
an atomic commit: a process killed mid-write leaves the previous state. Its index (keys and
sizes) is rebuilt from the kvstore's listing when it opens: an entry's size is part of its
stored name, `<key>@<bytes>`, so opening reads no entry. A long entry is stored as values of
`PART` bytes, `<key>@<bytes>`, `<key>@<bytes>.1`, ... committed together, so no single
value's conversion between Python bytes and tensorstore holds the GIL for long (a long
entry stored whole by an earlier jkv is left alone, as are names of other formats). An
entry may carry a small `meta` record (the store keeps its block hashes there), committed
with it as `<key>@<bytes>.meta` and read back in one batch by `metas()`; it is not counted
against the capacity. A database found damaged when it opens (its b-tree cannot be listed:
tensorstore says DATA_LOSS, or a node does not decode) is dropped and started empty
(`damaged`), so a bad disk costs recomputation, never a failed start.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import numpy as np
import tensorstore as ts

from jkv.store.codec import aligned, aligned_buffer

log = logging.getLogger(__name__)

PART = 8 << 20  # bytes per stored value (and per read) of an entry
_NAME = re.compile(r"(?P<key>[0-9A-Za-z_.:-]+)@(?P<size>\d+)(?:(?P<meta>\.meta)|\.(?P<part>\d+))?")


class TierFull(ValueError):
    """A write that would take the tier past its capacity."""


def _damaged(error: Exception) -> bool:
    """Whether tensorstore's error says the database's own bytes are damaged (then it is
    started again), not that it could not be reached."""
    text = str(error)
    return "DATA_LOSS" in text or "Error decoding b-tree node" in text


def _part_sizes(size: int) -> list[int]:
    """Bytes of each stored value of an entry of `size` bytes: its first at the entry's name,
    the others at name.1, name.2, ... (`PART` each, the last what remains)."""
    return [min(PART, size - a) for a in range(0, size, PART)] or [0]


def _part(name: str, index: int) -> str:
    return name if index == 0 else f"{name}.{index}"


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not re.fullmatch(r"[0-9A-Za-z_.:-]+", key):
        raise ValueError(f"entry keys are non-empty [0-9A-Za-z_.:-] strings, got {key!r}")
    return key


class HostTier:
    """Entries in host memory, at most `capacity` bytes of them, kept read-only and 64-byte
    aligned (`codec.aligned`: no copy of what `encode_aligned` made; a CPU backend then
    takes a restore's arrays as they are)."""

    name = "host"

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"host capacity must be >= 0 bytes, got {capacity}")
        self.capacity = capacity
        self._data: dict[str, memoryview] = {}
        self._meta: dict[str, bytes] = {}
        self.bytes_used = 0

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def keys(self) -> list[str]:
        return list(self._data)

    def size(self, key: str) -> int:
        return len(self._data[key])

    def put(self, key: str, data: bytes | memoryview, meta: bytes = b"") -> None:
        _check_key(key)
        old = len(self._data[key]) if key in self._data else 0
        if self.bytes_used - old + len(data) > self.capacity:
            raise TierFull(f"host tier: {len(data)} more bytes would exceed its capacity of "
                           f"{self.capacity} ({self.bytes_used} used)")
        self._data[key], self._meta[key] = aligned(data), bytes(meta)
        self.bytes_used += len(data) - old

    def get(self, key: str) -> memoryview | None:
        return self._data.get(key)

    def meta(self, key: str) -> bytes | None:
        return self._meta.get(key)

    def delete(self, key: str) -> None:
        data = self._data.pop(key, None)
        self._meta.pop(key, None)
        if data is not None:
            self.bytes_used -= len(data)


class PersistentTier:
    """Entries in a tensorstore kvstore through OCDBT (atomic commits), at most `capacity`
    bytes. `spec`: a local directory, or any tensorstore kvstore spec (a dict or a URL such
    as ``s3://bucket/prefix/``) to put the OCDBT database in."""

    name = "disk"

    def __init__(self, spec: str | os.PathLike | dict, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"disk capacity must be >= 0 bytes, got {capacity}")
        self.capacity = capacity
        if isinstance(spec, (str, os.PathLike)) and "://" not in str(spec):
            path = Path(spec).expanduser().resolve()
            path.mkdir(parents=True, exist_ok=True)
            base: dict | str = {"driver": "file", "path": f"{path}/"}
        else:
            base = spec
        self.damaged = False  # the database was unreadable at open and was started again
        try:
            names = self._open(base)
        except (ValueError, RuntimeError) as e:
            if not _damaged(e):  # unreachable, refused, misconfigured: say so
                raise ValueError(f"cannot open the KV store at {spec!r}: {e}") from e
            log.warning("the KV store at %r is damaged (%s); its entries are dropped and it "
                        "starts empty", spec, e)
            self.damaged = True
            names = self._reset(base)
        self._names: dict[str, str] = {}  # key -> stored name
        self._sizes: dict[str, int] = {}
        self._has_meta: set[str] = set()  # stored names with a meta record beside them
        self.bytes_used = 0
        self.foreign: list[str] = []  # stored names that are not entries (left alone)
        parts: dict[str, int] = {}  # stored name -> its values beyond the first
        for n in names:
            m = _NAME.fullmatch(n)
            if m is None:
                self.foreign.append(n)
            elif m["meta"]:
                self._has_meta.add(n[: -len(".meta")])
            elif m["part"]:
                owner = n[: -len(m["part"]) - 1]
                parts[owner] = parts.get(owner, 0) + 1
            else:
                self._names[m["key"]], self._sizes[m["key"]] = n, int(m["size"])
                self.bytes_used += int(m["size"])
        for key, name in list(self._names.items()):
            # a value missing (or an entry stored whole by an earlier jkv): not an entry
            if parts.pop(name, 0) != len(_part_sizes(self._sizes[key])) - 1:
                self.foreign.append(name)
                self.bytes_used -= self._sizes.pop(key)
                del self._names[key]
        self.foreign += [f"{n}.{i + 1}" for n, count in parts.items() for i in range(count)]
        # a meta record without its entry cannot be left by an atomic commit: not ours
        self.foreign += [f"{n}.meta" for n in self._has_meta - set(self._names.values())]

    def _open(self, base: dict | str) -> list[str]:
        self._kv = ts.KvStore.open({"driver": "ocdbt", "base": base}).result()
        return [n.decode() for n in self._kv.list().result()]

    def _reset(self, base: dict | str) -> list[str]:
        """Delete the OCDBT database's own files (its manifest and data files under ``d/``),
        nothing else under `base`, and open it again, empty. A damaged b-tree cannot be
        listed, so its entries could never be found again: dropping them is a miss for each."""
        raw = ts.KvStore.open(base).result()
        raw.delete_range(ts.KvStore.KeyRange("d/", "d0")).result()
        raw.delete_range(ts.KvStore.KeyRange("manifest.ocdbt", "manifest.ocdbt\0")).result()
        return self._open(base)

    def __contains__(self, key: str) -> bool:
        return key in self._names

    def keys(self) -> list[str]:
        return list(self._names)

    def size(self, key: str) -> int:
        return self._sizes[key]

    def put(self, key: str, data: bytes | memoryview, meta: bytes = b"") -> None:
        _check_key(key)
        old = self._sizes.get(key, 0)
        if self.bytes_used - old + len(data) > self.capacity:
            raise TierFull(f"disk tier: {len(data)} more bytes would exceed its capacity of "
                           f"{self.capacity} ({self.bytes_used} used)")
        name = f"{key}@{len(data)}"
        txn = ts.Transaction(atomic=True)  # the new names and the old ones' removal together
        kv = self._kv.with_transaction(txn)
        if key in self._names:
            self._delete_name(self._names[key], txn)
        view, at = memoryview(data).cast("B"), 0
        for i, n in enumerate(_part_sizes(len(view))):  # one commit makes them all visible
            kv.write(_part(name, i), bytes(view[at:at + n])).result()  # it takes bytes only
            at += n
        if meta:
            kv.write(f"{name}.meta", bytes(meta)).result()
        txn.commit_async().result()
        self._has_meta.discard(self._names.get(key))
        if meta:
            self._has_meta.add(name)
        self._names[key], self._sizes[key] = name, len(data)
        self.bytes_used += len(data) - old

    def _read(self, name: str) -> bytes | None:
        try:
            r = self._kv.read(name).result()
        except (ValueError, RuntimeError):
            return None
        return bytes(r.value) if r.state == "value" else None

    def meta(self, key: str) -> bytes | None:
        name = self._names.get(key)
        return None if name not in self._has_meta else self._read(f"{name}.meta")

    def metas(self) -> dict[str, bytes]:
        """Every entry's meta record, read in one batch of concurrent reads (entries without
        one, or whose record cannot be read, are left out)."""
        futures = {k: self._kv.read(f"{n}.meta") for k, n in self._names.items()
                   if n in self._has_meta}
        out = {}
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
        sizes = _part_sizes(self._sizes[key])
        out = aligned_buffer(sum(sizes))
        try:
            reads = [self._kv.read(_part(name, i)) for i in range(len(sizes))]
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
        name = self._names.pop(key, None)
        if name is not None:
            self.bytes_used -= self._sizes.pop(key)
            self._has_meta.discard(name)
            self._delete_name(name)

    def _delete_name(self, name: str, txn: ts.Transaction | None = None) -> None:
        """Delete an entry's values and its meta record (one range: name, name.1, ...,
        name.meta)."""
        kv = self._kv if txn is None else self._kv.with_transaction(txn)
        kv.delete_range(ts.KvStore.KeyRange(name, name + ".meta\0")).result()
