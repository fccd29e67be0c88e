"""The files of an OCDBT database in a local directory (the persistent tier on a path): the
bytes they take, the space left beside them, a damaged database set aside, and compaction.

OCDBT never deletes a data file: every commit writes a new one under ``d/`` and an entry
deleted or replaced keeps its bytes there, so a database's files only grow. A compaction
copies the live values into a fresh database beside it (``.compacting/``), moves its data
files in (their names are unique) and renames its manifest over the old one: that rename is
the commit point (killed before it, the old database stands; after, the new one), and every
data file the new manifest does not name is then removed (so are those a killed compaction
left). With nothing live it only removes the files, so it needs no room at all.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import tensorstore as ts

log = logging.getLogger("jkv.store.store")  # (the store's one logger)

MANIFEST, DATA, NEXT = "manifest.ocdbt", "d", ".compacting"
BATCH = 64 << 20  # bytes copied per commit of a compaction


def damaged(error: Exception) -> bool:
    """Whether tensorstore's error says an OCDBT database's own bytes are damaged (then it
    is started again), not that it could not be reached."""
    text = str(error)
    return ("DATA_LOSS" in text or "Error decoding" in text  # flipped bytes
            or ("OUT_OF_RANGE" in text and "byte range" in text.lower()))  # a file cut short


def out_of_space(error: Exception) -> bool:
    """Whether tensorstore's error says a write failed for want of space (or quota)."""
    text = str(error)
    return any(s in text for s in ("RESOURCE_EXHAUSTED", "No space left", "quota exceeded",
                                   "os_error_code='28'", "os_error_code='122'"))


def open_db(base: Path | str | dict, coordinator: str | None = None) -> ts.KvStore:
    """The OCDBT database in `base` (a directory or a kvstore spec), opened afresh (no
    manifest cached from before a swap); through the OCDBT `coordinator` at that address
    when several processes write it."""
    if isinstance(base, Path):
        base = {"driver": "file", "path": f"{base}/"}
    spec = {"driver": "ocdbt", "base": base}
    if coordinator is not None:
        spec["coordinator"] = {"address": coordinator}
    return ts.KvStore.open(spec, context=ts.Context()).result()


def footprint(path: Path) -> int:
    """Bytes of the database's files: its manifest and data files."""
    total = 0
    for p in (path / MANIFEST, *_data_files(path / DATA)):
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            pass
    return total


def _data_files(d: Path) -> list[Path]:
    return [p for p in d.iterdir() if p.is_file()] if d.is_dir() else []


def space_probe(path: Path) -> Callable[[], int]:
    """Bytes the database's files may still take on `path`'s filesystem: what it has free
    less a margin (a twentieth of its size, at most 1 GiB) for the database's own bookkeeping and
    the other users of the filesystem."""

    def free() -> int:
        du = shutil.disk_usage(path)
        return max(0, du.free - min(1 << 30, du.total // 20))

    return free


def set_aside(path: Path, now: datetime | None = None) -> Path | None:
    """Move a damaged database's files (manifest and data files; nothing else in `path`) to
    a dated sibling folder, ``<dir>.damaged-YYYYmmddTHHMMSS`` (inside `path` where the
    sibling cannot be made: another filesystem, no permission), kept for inspection: its
    path, or None when there were none."""
    names = [n for n in (MANIFEST, DATA) if (path / n).exists()]
    if not names:
        return None
    stamp = f"damaged-{(now or datetime.now()).strftime('%Y%m%dT%H%M%S')}"
    for parent, prefix in ((path.parent, f"{path.name}."), (path, ".")):
        dest = _unused(parent / f"{prefix}{stamp}")
        try:
            dest.mkdir(parents=True)
            for n in names:
                os.rename(path / n, dest / n)
            return dest
        except OSError as e:  # another filesystem, read-only parent: try inside
            log.debug("cannot set the damaged KV store aside to %s: %s", dest, e)
            for n in names:
                if (dest / n).exists() and not (path / n).exists():
                    os.rename(dest / n, path / n)
            shutil.rmtree(dest, ignore_errors=True)
    raise OSError(f"cannot move the damaged KV store in {path} aside")


def _unused(dest: Path) -> Path:
    """`dest`, or `dest-1`, `dest-2`... when taken (two resets in one second)."""
    n, out = 0, dest
    while out.exists():
        n += 1
        out = dest.with_name(f"{dest.name}-{n}")
    return out


def discard_unfinished(path: Path) -> None:
    """Remove what a compaction killed before its commit point left (its fresh database)."""
    shutil.rmtree(path / NEXT, ignore_errors=True)


def copy_live(path: Path, kv: ts.KvStore, names: list[str]) -> Path:
    """Copy the values `names` of the open database `kv` (in `path`) into a fresh database
    in ``path/.compacting``, committed a batch at a time; its folder. Raises (leaving
    nothing behind) when the copy fails, e.g. with the filesystem full."""
    nxt = path / NEXT
    discard_unfinished(path)
    try:
        new = open_db(nxt)
        txn, held = ts.Transaction(), 0
        for name in names:
            r = kv.read(name).result()
            if r.state != "value":
                continue
            new.with_transaction(txn).write(name, r.value).result()
            held += len(r.value)
            if held >= BATCH:
                txn.commit_async().result()
                txn, held = ts.Transaction(), 0
        txn.commit_async().result()
    except BaseException:
        discard_unfinished(path)
        raise
    return nxt


def wipe(path: Path) -> None:
    """Remove the database's files (a compaction with nothing live: it needs no room)."""
    (path / MANIFEST).unlink(missing_ok=True)
    for f in _data_files(path / DATA):
        f.unlink(missing_ok=True)
    discard_unfinished(path)


def swap_in(path: Path, nxt: Path) -> None:
    """Make the database `copy_live` built in `nxt` the one in `path` (its data files moved
    in, then its manifest renamed over the old one), then remove every data file it does
    not name."""
    keep = set()
    (path / DATA).mkdir(exist_ok=True)
    for f in _data_files(nxt / DATA):
        os.rename(f, path / DATA / f.name)
        keep.add(f.name)
    os.replace(nxt / MANIFEST, path / MANIFEST)  # the commit point
    for f in _data_files(path / DATA):
        if f.name not in keep:
            f.unlink(missing_ok=True)
    discard_unfinished(path)


class LocalDatabase:
    """The tier's database in directory `path`: the bytes its files take (`footprint`,
    measured when opened and compacted, counted up by each write between), the space left
    beside them (`free_space`: `space_probe` unless given), and its compactions. `lock`
    keeps reads off the files while a compaction swaps them."""

    def __init__(self, path: Path, free_space: Callable[[], int] | None = None) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        discard_unfinished(path)
        self.free_space = free_space or space_probe(path)
        self.lock = threading.Lock()
        self.footprint = 0
        self.compactions = 0

    def measure(self) -> None:
        self.footprint = footprint(self.path)

    def fit(self, capacity: int) -> int:
        """`capacity`, at most a third of what the files take and may still take: deleted
        bytes stay until a compaction, which copies what is live beside them."""
        return min(capacity, (self.free_space() + self.footprint) // 3)

    def wants_compaction(self, live: int, size: int, capacity: int) -> bool:
        """Whether to compact before writing `size` bytes (`live`: the live values' bytes):
        the deleted bytes outgrow the capacity, or after this write a compaction would no
        longer fit; never when the copy itself would not fit."""
        garbage, free = self.footprint - live, self.free_space()
        return garbage > 0 and free >= live and (
            garbage > capacity or (garbage >= size and free < live + 2 * size))

    def compact(self, kv: ts.KvStore, names: list[str],
                install: Callable[[ts.KvStore], None]) -> bool:
        """Compact the database `kv` has open to its values `names` (`copy_live`,
        `swap_in`; none: `wipe`) and `install` it opened afresh (under `lock`, with the
        swap); False (nothing changed) when the copy failed."""
        try:
            nxt = copy_live(self.path, kv, names) if names else None
        except (ValueError, RuntimeError, OSError) as e:
            log.warning("could not compact the KV store at %s: %s", self.path, e)
            return False
        with self.lock:
            if nxt is None:
                wipe(self.path)
            else:
                swap_in(self.path, nxt)
            install(open_db(self.path))
        self.measure()
        self.compactions += 1
        return True
