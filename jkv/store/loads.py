"""The KV store's read side (`StoreReader`, a part `jkv.store.store.KVStore` composes).

`load` reads an entry and the chain it continues (read, checksum, checks against the index
record), converting an entry stored in another KV form into the pool's (approximate KV,
`Loaded.exact_blocks`); the tier's read rate and each stored format's conversion rate are
measured apart (restore planning and AdaptCache weigh them). `read_ahead` runs `load` on the
store's reader thread (`reads.ReadAhead`) and `take` hands its result over at admission
without waiting. A corrupt or foreign entry is a miss, counted and deleted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import NamedTuple

import numpy as np

from jkv.averages import moving_average
from jkv.kv.block_runs import BlockRuns
from jkv.kv.buckets import bucket
from jkv.store.codec import CorruptEntry, EntryMismatch, decode
from jkv.store.entry_forms import HASHES
from jkv.store.fronts import restore_front
from jkv.store.index import Hit
from jkv.store.parts import StoreParts
from jkv.store.reads import ReadAhead
from jkv.store.verify import Mark, pop_mark
from jkv.store.writes import log


class Loaded(NamedTuple):
    """What `load` read: `arrays` [blocks, ...] in the pool's format and their block
    `hashes`; blocks from `exact_blocks` on (None: none) were stored in another form and
    converted, so they hold approximate KV (usable by the prompt, never shared under their
    tokens' hashes); `mark`: the fingerprint of the token just past the blocks, where the
    entry ending there keeps one (`jkv.store.verify`); `front` [layers]: blocks [0, front[l])
    of layer l were not stored (`jkv.store.fronts`: zeros here), a restore recomputes them."""

    arrays: dict
    hashes: list[bytes]
    exact_blocks: int | None = None
    mark: Mark | None = None
    front: np.ndarray | None = None


class _Part(NamedTuple):
    """One entry of a chain as read: its arrays in the pool's format, block hashes, stored
    bytes, first approximate block in the run (None: exact; its first block when it was
    stored in another form and converted), the seconds converting it took and its
    fingerprint."""

    arrays: dict
    hashes: list[bytes]
    nbytes: int
    approx_from: int | None
    convert_s: float
    mark: Mark | None = None
    front: np.ndarray | None = None  # the root entry's blocks not stored, per layer


class StoreReader:
    """Loading entries and handing reads ahead over, over the store's shared `StoreParts`;
    `submit` queues a job for the store's writer thread, `delete` drops an entry (a corrupt
    one, on the writer)."""

    def __init__(self, parts: StoreParts, submit: Callable[[Callable[[], None]], bool],
                 delete: Callable[[str], None]) -> None:
        self.p, self._submit, self._delete = parts, submit, delete
        self._converted_shapes: set[tuple[str, int]] = set()
        self._reads = ReadAhead(self.load, parts.max_pending_bytes)

    def close(self) -> None:
        """Stop the reader thread."""
        self._reads.close()

    def load(self, hit: Hit) -> Loaded | None:
        """The first `hit.blocks` blocks of entry `hit.key` and its chain: arrays [blocks,
        ...] in the pool's format (a chain's as `BlockRuns`, its entries' arrays uncopied),
        or a whole entry's arrays as saved, and their block hashes, validated (`Loaded`);
        None on a miss (gone, or corrupt: then counted and deleted). An entry still being
        saved is read once written."""
        with self.p.lock:
            pending = self.p.pending.get(hit.key)
        if pending is not None:
            pending.written.wait()  # the writer writes in order: its parents are written
        t0 = time.perf_counter()
        with self.p.lock:
            chain = self.p.index.chain(hit.key) if hit.key in self.p.index else None
        if chain is None:
            return None
        parts, nbytes, exact, convert_s = [], 0, None, 0.0
        for key in chain:
            part = last = self._load_one(key, hit.tier)
            if part is None:
                return None
            if not parts:
                front = part.front  # (only a root entry leaves blocks to recompute)
            if exact is None:  # the chain's first approximate block (root first)
                exact = part.approx_from
            parts.append((part.arrays, part.hashes))
            nbytes += part.nbytes
            convert_s += part.convert_s
        with self.p.lock:
            for key in chain:  # (the reuse gap AdaptCache learns from is the hit's own)
                self.p.placement.access(key, own=key == chain[-1])
        self.p.stats.loads += 1
        # the tier's rate: reading, checksumming and checking (conversions are per form)
        rate = nbytes / max(time.perf_counter() - t0 - convert_s, 1e-9)
        self.p.read_bytes_per_s[hit.tier] = moving_average(self.p.read_bytes_per_s[hit.tier], rate)
        n = hit.blocks
        exact = None if exact is None or exact >= n else exact
        # the last entry's fingerprint is of the token after the whole chain's blocks
        mark = last.mark if n == sum(len(hs) for _, hs in parts) else None
        if len(parts) == 1:
            arrays, hashes = parts[0]
            if n == len(hashes):  # the whole entry (a whole row's arrays are not blocks)
                return Loaded(dict(arrays), list(hashes), exact, mark, front)
            return Loaded({f: x[:n] for f, x in arrays.items()}, hashes[:n], exact, mark,
                          front)
        hashes = [h for _, hs in parts for h in hs][:n]
        # a chain is handed over in its parts: a restore writes runs inside each, uncopied
        return Loaded({f: BlockRuns([a[f] for a, _ in parts]).head(n) for f in parts[0][0]},
                      hashes, exact, mark, front)

    def _load_one(self, key: str, tier: str) -> _Part | None:
        """One entry, validated against its index record (`_Part`); None on a miss (a
        corrupt entry and what continues it: counted, deleted)."""
        tiers = (self.p.host, self.p.disk) if tier == "host" else (self.p.disk, self.p.host)
        data = None
        for t in tiers:  # the entry may be moving between tiers right now
            if t is not None and (data := t.get(key)) is not None:
                break
        if data is None:
            return None
        with self.p.lock:
            entry = self.p.index.get(key)
        try:
            if entry is None:
                return None
            info, arrays = decode(data, model=self.p.model,
                                  kv_format=None if self.p.convert else self.p.kv_format,
                                  page_size=self.p.page_size, align=self.p.aligned_reads)
            stored, mark = arrays.pop(HASHES, None), pop_mark(arrays)
            if stored is None or [r.tobytes() for r in stored] != entry.hashes:
                raise CorruptEntry("the entry's block hashes differ from its index record")
            try:
                front = restore_front(arrays, len(entry.hashes))
            except ValueError as e:
                raise CorruptEntry(str(e)) from None
            exact = info.kv_format == self.p.kv_format
            convert_s = 0.0
            if not exact:
                t0 = time.perf_counter()
                try:
                    arrays = self.p.convert(arrays, info.kv_format, self.p.kv_format)
                except ValueError as e:
                    raise EntryMismatch(f"a {info.kv_format} entry: {e}") from None
                convert_s = time.perf_counter() - t0
                self._measure_conversion(info.kv_format, len(data), len(entry.hashes),
                                         convert_s)
                self.p.stats.converted_loads += 1
        except (CorruptEntry, EntryMismatch) as e:
            log.warning("stored KV entry %s is unusable (%s); recomputing", key, e)
            self.p.stats.corrupt_entries += 1
            with self.p.lock:
                removed = self.p.index.remove(key)  # no second lookup finds them
            for k in removed:  # the writer deletes them
                self._submit(lambda k=k: self._delete(k))
            return None
        if not exact and entry.form is None:  # (a record written before forms were kept;
            with self.p.lock:                  # a recorded one is the writer's to change)
                entry.form = info.kv_format
        return _Part(arrays, entry.hashes, len(data),
                     entry.approx_from if exact else entry.start, convert_s, mark, front)

    def _measure_conversion(self, kv_format: str, nbytes: int, blocks: int,
                            seconds: float) -> None:
        """Fold a conversion's rate into `convert_bytes_per_s[kv_format]`; the first at a
        padded block count (`buckets.bucket`, as the conversion pads) is left out: it
        compiled."""
        shape = (kv_format, bucket(blocks))
        with self.p.lock:
            if shape not in self._converted_shapes:
                self._converted_shapes.add(shape)
                return
            rates = self.p.convert_bytes_per_s
            rates[kv_format] = moving_average(rates.get(kv_format, 0.0),
                                              nbytes / max(seconds, 1e-9))

    def quarantine(self, key: str) -> int:
        """Never serve `key`'s chain again (a restore of it failed its check, `jkv.store.verify`;
        the wrong blocks may be in any entry of it): its root and every entry continuing the
        root leave the index now, their bytes deleted by the writer; returns how many."""
        with self.p.lock:
            removed = (self.p.index.remove(self.p.index.chain(key)[0])
                       if key in self.p.index else [])
            self.p.stats.quarantined += len(removed)
        for k in removed:
            self._submit(lambda k=k: self._delete(k))
        return len(removed)

    def read_ahead(self, hit: Hit) -> bool:
        """Have `hit` loaded (`load`) on the store's reader thread unless it is under way
        already; True once the result is ready for `take`. Never waits: a request whose
        read is not ready waits in the queue, and the steps of the others go on."""
        return self._reads.start(hit)

    def take(self, hit: Hit) -> tuple[Loaded, str] | None:
        """What `read_ahead(hit)` read: `load`'s result and the tier it was read from, or
        None (a miss: the entry gone, corrupt or its tier failing, or no read ready); never
        waits."""
        try:
            read = self._reads.take(hit)
        except Exception:  # a failing tier: a miss, counted
            self.p.stats.read_failures += 1
            return None
        return None if read is None or read[0] is None else read

    def wait_reads(self, timeout: float) -> None:
        """Wait until a read ahead is done, at most `timeout` seconds (a loop with nothing
        else to do, instead of spinning)."""
        self._reads.wait(timeout)

    def drop_reads(self, keep: Collection[Hit]) -> None:
        """Forget the reads ahead of hits not in `keep` (their requests left the queue or
        will recompute): their bytes are freed, a read not started is cancelled."""
        self._reads.drop(keep)


__all__ = ["Loaded", "StoreReader"]
