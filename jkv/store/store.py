"""The KV store: finished requests' pages kept in host memory and a persistent tier, found
again by chained block hash, never served corrupt.

An entry is a run of a request's full blocks, named by the hash of its last block: blocks
0..n-1 of its tokens, or (a tail, `save(start=s)`) blocks s..n-1 continuing the entry that
ends at block s-1, so a request saved as its blocks fill, or whose history was restored,
writes only its new blocks (`index`: chains of entries). Every block hash of every entry is
indexed, so a later prompt that shares any leading run of blocks with an entry (the next
turn of a chat, a regenerated answer) finds it, read along its chain; a new root entry that
extends an older one nothing continues (the next turn's save) replaces it. A whole row
(token tiers: its pages are not blocks) is found only whole (`lookup(whole=True)`) and
replaces nothing. Which tier holds an entry, and what a full tier gives up, is
`Placement`'s decision (LRU, FIFO or scheduler-aware, with the waiting queue as its hint).

The index, lookups, hints and the writer thread are here; loading entries and handing
reads ahead over are `StoreReader` (`loads.py`); saving, writing, moving and recompressing
entries are `StoreWriter` (`writes.py`); both are given the state they share
(`parts.StoreParts`) explicitly. Threads: `lookup` runs on the
scheduler's thread (the index only); `read_ahead` loads an entry
(read, checksum, decode) on the store's reader thread while the request waits in the queue,
and `take` hands the result over at admission without waiting, so a slow or failing tier
never stalls a step (`load` is the same read, on the caller's thread); saving (the copy off
the device, encoding, checksumming, writing) and moving entries between tiers run on one
background writer, so a finishing request never waits for its save; `lookup` finds a save not
yet written too (a preempted request readmitted at once), and its read waits for the write.
The index is rebuilt from the persistent tier's meta records when the store opens, and kept
up with what other processes write to a shared one (`adoption`).
A lossy store (entries in smaller forms: `store_kv_format`, AdaptCache) restores approximate
KV, and is saved approximate blocks too (a conversation restored from it goes on in it),
marked so in their entry: any restore of them is approximate, whatever form holds them. An entry
that fails to decode (torn, flipped bytes, foreign) is a miss, counted in `corrupt_entries`,
and deleted.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Collection, Mapping, Sequence

from jkv.config import StoreConfig
from jkv.store.adapt_profile import Profile
from jkv.store.adapt_store import AdaptStorePlacement
from jkv.store.adoption import Refresher, adopt, sync_shared
from jkv.store.entry_forms import store_form
from jkv.store.host_tier import HostTier
from jkv.store.index import Hit
from jkv.store.loads import Loaded, StoreReader
from jkv.store.parts import StoreParts, StoreStats
from jkv.store.placement import TIERS, Placement
from jkv.store.priority import lower_thread_priority
from jkv.store.tiers import PersistentTier
from jkv.store.writes import StoreWriter

log = logging.getLogger(__name__)


def _converted(parts: Sequence[tuple[int, str | None]]) -> tuple[tuple[str, int], ...]:
    """`Hit.converted` of a chain's (stored bytes, form) parts: those in another form."""
    return tuple((form, size) for size, form in parts if form is not None)


class KVStore:
    """Host and persistent tiers behind one index; see the module docstring.

    model: the fingerprint of the KV written (`Engine.fingerprint`: model, format, page size);
    entries of other fingerprints in a shared persistent tier are never matched; they count
    against the capacity and are evicted like any other entry when room is needed.
    max_pending_bytes: most bytes of saves waiting for the writer (each holds a device copy
    of its pages until written); a save past it is dropped and counted. Reads ahead hold at
    most as many bytes (a request past it waits for room).
    aligned_reads: loaded arrays start on 64-byte boundaries (`codec.aligned`: a copy on the
    reading thread where a tier's bytes are not), as a CPU backend takes them without a copy.
    convert: `convert(arrays, src, dst)` gives pages of KV format `src` as those of `dst`
    (`Engine.convert_stored`): an entry stored in another form (smaller: AdaptCache) is
    read into the pool's format on the reading thread, and `recompress` makes such forms;
    without it an entry of another format is a mismatch (a miss). bf16_ratio: an entry's
    bytes in bf16 over its bytes as stored (AdaptCache's profile rates are against bf16).
    backend: the JAX backend conversions run on (AdaptCache's profile decode rates are per
    backend). whole_rows: the engine keeps token tiers (its entries are whole rows, whose
    smaller forms drop tokens: AdaptCache takes the profile's row forms). free_space: bytes
    the persistent tier's files may still take on their filesystem (`PersistentTier`;
    default: measured there).
    """

    def __init__(self, config: StoreConfig, *, model: str, kv_format: str,
                 page_size: int, max_pending_bytes: int = 2 << 30,
                 aligned_reads: bool = False,
                 convert: Callable[[dict, str, str], dict] | None = None,
                 bf16_ratio: float = 1.0, backend: str = "cpu", whole_rows: bool = False,
                 free_space: Callable[[], int] | None = None) -> None:
        if not config.enabled:
            raise ValueError("the store needs host_cache_bytes > 0 or a store_dir/store_spec "
                             "with disk_cache_bytes > 0")
        host = HostTier(config.host_cache_bytes)
        disk = (None if config.persistent is None or not config.disk_cache_bytes
                else PersistentTier(config.persistent, config.disk_cache_bytes, free_space,
                                    config.store_coordinator))
        form = store_form(config, kv_format, whole_rows)  # entries are written in
        if form is not None and convert is None:
            raise ValueError(f"the store's form {form} needs the engine's KV format "
                             "conversion")
        disk_bytes = 0 if disk is None else disk.capacity  # (fitted to its filesystem)
        if config.eviction_policy == "adaptcache":
            if convert is None or (not whole_rows and kv_format not in ("auto", "bf16")):
                raise ValueError("eviction_policy adaptcache needs the engine's KV format "
                                 "conversion and, without token tiers, a pool in the model "
                                 "dtype (kv_format auto)")
            placement = AdaptStorePlacement(
                Profile.default(whole_rows) if config.adapt_profile is None
                else Profile.load(config.adapt_profile), config.adapt_alpha,
                config.adapt_quality_floor, config.host_cache_bytes, disk_bytes,
                1.0 if whole_rows else bf16_ratio, config.adapt_half_life, backend,
                whole_rows)
        else:
            placement = Placement(config.eviction_policy, config.host_cache_bytes, disk_bytes)
        self.p = p = StoreParts(
            config, model, kv_format, page_size, form, convert, aligned_reads, host, disk,
            placement, StoreStats(disk_resets=int(disk is not None and disk.damaged)),
            max_pending_bytes)
        # the parts' objects under their own names (never reassigned)
        self.config, self.model, self.kv_format, self.page_size = config, model, kv_format, \
            page_size
        self.host, self.disk, self.form, self.placement = host, disk, form, placement
        self.stats, self.index = p.stats, p.index
        self.read_bytes_per_s, self.convert_bytes_per_s = (p.read_bytes_per_s,
                                                           p.convert_bytes_per_s)
        self._jobs: queue.Queue = queue.Queue()
        self.writer = StoreWriter(p, self._submit, self._reachable, self.flush)
        self.reader = StoreReader(p, self._submit, self.writer.delete)
        if disk is not None:
            adopt(p, disk.keys(), opening=True, set_capacity=self._set_disk_capacity)
        self._writer = threading.Thread(target=self._work, name="jkv-store-writer",
                                        daemon=True)
        self._writer.start()
        self._refresher = Refresher(self._submit, self._sync_shared) if p.shared else None

    # ------------------------------------------------------------------ opening

    def _set_disk_capacity(self, capacity: int) -> None:
        self.writer.apply(self.placement.set_capacity("disk", capacity))

    def refresh(self) -> None:
        """Take up now what a shared persistent tier's other writers changed (done every
        `adoption.REFRESH_S` seconds anyway); returns once done."""
        if self.p.shared:
            self._submit(self._sync_shared)
            self.flush()

    def _sync_shared(self) -> None:
        sync_shared(self.p, self.writer.delete, self._set_disk_capacity)

    # ------------------------------------------------------------------ index

    def lookup(self, hashes: Sequence[bytes], whole: bool = False) -> Hit | None:
        """The longest run of `hashes` (a prompt's block hashes) that an entry (with its
        chain) holds, from the host tier when two entries hold it; None when none does.
        `whole`: only an entry's whole run (a whole row is not usable in part)."""
        with self.p.lock:
            lo = self.index.whole_run(hashes) if whole else self.index.run(hashes)
            pending = self._pending_run(hashes, whole)
            if pending is not None and pending[1] > lo:  # its reads wait for the write
                key, n = pending
                p = self.p.pending[key]
                parts = self._chain_parts(key)
                before = sum(size for size, _ in parts[:-1])
                return Hit(key, n, self._pending_tier(key), before + p.nbytes,
                           before + p.nbytes * (n - p.start) // len(p.hashes),
                           _converted(parts))
            if lo == 0:
                return None
            holders = self.index.holders(hashes[lo - 1])
            if whole:
                holders = [k for k in holders if self.index.entries[k].stop == lo]
            tiers = {k: self._chain_tier(k) for k in holders}
            tiers = {k: t for k, t in tiers.items() if t is not None}  # not mid-eviction
            if not tiers:
                return None
            key = min(tiers, key=lambda k: (tiers[k] != "host", k))
            entry = self.index.entries[key]
            parts = self._chain_parts(key)
            sizes = [size for size, _ in parts]
            return Hit(key, lo, tiers[key], sum(sizes),
                       sum(sizes[:-1]) + sizes[-1] * (lo - entry.start) // len(entry.hashes),
                       _converted(parts))

    def _chain_tier(self, key: str) -> str | None:
        """Where `key`'s chain is read from (under the lock): "host" when every entry of it
        is there, "disk" when one is not, None when one is in no tier (mid-eviction)."""
        tiers = [self.placement.where(k) for k in self.index.chain(key)]
        return None if None in tiers else "host" if set(tiers) == {"host"} else "disk"

    def _pending_tier(self, key: str) -> str:
        """The tier a queued save's chain is read from (under the lock): the host's unless
        an entry it continues is on disk."""
        parent = self.p.pending[key].parent
        if parent is None:
            return "host"
        if parent in self.p.pending:
            return self._pending_tier(parent)
        return "host" if self._chain_tier(parent) == "host" else "disk"

    def _chain_parts(self, key: str) -> list[tuple[int, str | None]]:
        """(stored bytes, KV format: None for the pool's) of each entry of `key`'s chain,
        root first (under the lock; a save not yet written counts its bytes, in the pool's
        format: its form is chosen as it is written)."""
        if key in self.p.pending:
            p = self.p.pending[key]
            return ([] if p.parent is None else self._chain_parts(p.parent)) + [(p.nbytes, None)]
        return [(self.placement.size(k) or 0, self.index.entries[k].form)
                for k in self.index.chain(key)]

    def tail_start(self, hashes: Sequence[bytes]) -> int:
        """The most leading blocks of `hashes` that an entry (written or queued) ends with:
        a save of this run need only write the blocks after them (`save(start=...)`)."""
        with self.p.lock:
            return next((i + 1 for i in range(len(hashes) - 1, -1, -1)
                         if self._reachable(hashes[i].hex())), 0)

    def _reachable(self, key: str) -> bool:
        """Whether `key` is written or queued with every entry it continues (under the
        lock): a queued tail whose parent went (evicted, dropped) is of no use."""
        while key in self.p.pending:
            key = self.p.pending[key].parent
            if key is None:
                return True
        return key in self.index

    def _pending_run(self, hashes: Sequence[bytes], whole: bool) -> tuple[str, int] | None:
        """The longest run of `hashes` that a save not yet written holds (under the lock)."""
        best = None
        for key, p in self.p.pending.items():
            if not self._reachable(key):
                continue
            s = p.start
            if whole:
                n = len(p.hashes) if (p.whole and len(p.hashes) <= len(hashes)
                                      and hashes[len(p.hashes) - 1] == p.hashes[-1]) else 0
            else:  # chained hashes: equal at block i means equal at every block before it
                n = next((s + i + 1 for i in range(min(len(p.hashes), len(hashes) - s) - 1,
                                                    -1, -1)
                          if p.hashes[i] == hashes[s + i]), 0)
            if n and (best is None or n > best[1]):
                best = (key, n)
        return best

    # ------------------------------------------------------------------ hints

    def set_recompute_rate(self, token_s: float) -> None:
        """Seconds a recomputed token costs (the scheduler's measure): what a miss costs,
        for AdaptCache's placement."""
        if self.placement.weighs_recompute and token_s != self.placement.recompute_token_s:
            with self.p.lock:
                self.placement.set_recompute_rate(token_s)

    def hint(self, waiting: Sequence[str]) -> None:
        """The scheduler's queue: entry keys of the waiting requests in the order they will
        run. Eviction keeps them; the scheduler-aware policy prefetches them disk -> host."""
        with self.p.lock:  # a tail's chain is needed whole
            waiting = [k for key in waiting
                       for k in (self.index.chain(key) if key in self.index else [key])]
            if waiting == self.p.queue:
                return
            self.p.queue = waiting
        if self.config.eviction_policy == "scheduler" and self.disk is not None:
            self._submit(self._prefetch)

    def _prefetch(self) -> None:
        with self.p.lock:
            moves = self.placement.prefetch(self.p.queue)
        self.writer.apply(moves)

    # ------------------------------------------------------------------ the writer

    def _submit(self, job: Callable[[], None]) -> bool:
        """Queue a job for the writer; False once the store is closed."""
        with self.p.lock:
            if self.p.closed:
                return False
            self._jobs.put(job)
            return True

    def _work(self) -> None:
        lower_thread_priority()
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                job()
            except Exception:  # a failed save must never reach the serving loop
                log.exception("a KV store job failed")
                self.stats.save_failures += 1
            finally:
                self._jobs.task_done()

    def flush(self) -> None:
        """Wait until every queued save and move is done."""
        self._jobs.join()

    def close(self) -> None:
        """Finish queued writes, move what the host tier holds to the persistent tier (most
        recently used first, as capacity allows), and stop the writer."""
        with self.p.lock:
            if self.p.closed:
                return
            self.p.closed = True
            if self.disk is not None:
                self._jobs.put(self._spill_all)
            self._jobs.put(None)
        if self._refresher is not None:
            self._refresher.stop()
        self.reader.close()
        self._writer.join()

    def _spill_all(self) -> None:
        with self.p.lock:
            keys = self.placement.by_recency("host")
        for key in keys:
            with self.p.lock:
                moves = self.placement.spill(key, self.p.queue)
            self.writer.apply(moves)

    # ------------------------------------------------------------------ its parts' own

    def load(self, hit: Hit) -> Loaded | None:
        """`StoreReader.load`."""
        return self.reader.load(hit)

    def read_ahead(self, hit: Hit) -> bool:
        """`StoreReader.read_ahead`."""
        return self.reader.read_ahead(hit)

    def take(self, hit: Hit) -> tuple[Loaded, str] | None:
        """`StoreReader.take`."""
        return self.reader.take(hit)

    def wait_reads(self, timeout: float) -> None:
        self.reader.wait_reads(timeout)

    def drop_reads(self, keep: Collection[Hit]) -> None:
        self.reader.drop_reads(keep)

    @property
    def keeps_approximate(self) -> bool:
        """`StoreWriter.keeps_approximate`."""
        return self.writer.keeps_approximate

    def save(self, num_blocks: int, arrays: Mapping[str, object], hashes: Sequence[bytes],
             session: str | None = None, rows: int | None = None, start: int = 0,
             exact_blocks: int | None = None, form: str | None = None,
             mark: tuple | None = None, front=None) -> bool:
        """`StoreWriter.save`."""
        return self.writer.save(num_blocks, arrays, hashes, session, rows, start,
                                exact_blocks, form, mark, front)

    def clear(self) -> None:
        """`StoreWriter.clear`."""
        self.writer.clear()

    def recompress(self, key: str, kv_format: str) -> bool:
        """`StoreWriter.recompress`."""
        return self.writer.recompress(key, kv_format)

    # ------------------------------------------------------------------ figures

    def snapshot(self) -> dict:
        """Entries and bytes per tier and the event counters (`LLM.stats()["store"]`)."""
        with self.p.lock:
            entries = {t: len(self.placement.sessions(t)) for t in TIERS}
            used = {t: self.placement.bytes_used(t) for t in TIERS}
        st = self.stats
        return {"entries": entries, "bytes": used,
                "capacity_bytes": {"host": self.host.capacity,
                                   "disk": 0 if self.disk is None else self.disk.capacity},
                "corrupt_entries": st.corrupt_entries, "evictions": st.evictions,
                "prefetches": st.prefetches, "offloads": st.offloads, "saves": st.saves,
                "loads": st.loads, "read_failures": st.read_failures,
                "superseded": st.superseded,
                "save_failures": st.save_failures, "saves_dropped": st.saves_dropped,
                "save_retries": st.save_retries, "disk_full": st.disk_full,
                "compactions": 0 if self.disk is None else self.disk.compactions,
                "disk_resets": st.disk_resets, "converted_loads": st.converted_loads,
                "quarantined": st.quarantined,
                "shared_entries": st.shared_entries, "shared_groups": st.shared_groups,
                "shared_bytes_saved": st.shared_bytes_saved,
                "shared_refused": st.shared_refused,
                "lossless_entries": st.lossless_entries,
                "lossless_bytes_saved": st.lossless_bytes_saved,
                "written_through": st.written_through,
                "write_through_failures": st.write_through_failures,
                "read_bytes_per_s": dict(self.read_bytes_per_s),
                "convert_bytes_per_s": dict(self.convert_bytes_per_s),
                **self.placement.stats()}
