"""Reads ahead: stored entries loaded on the store's reader thread while their requests wait
in the queue, handed over at admission without waiting (CachedAttention's read buffer).

A slow or failing tier then never stalls a step: a read that is not ready leaves its request
waiting, one that raised is a miss (counted by the store). What the reads hold is bounded by
bytes, so a long queue does not fill host memory with entries read far ahead.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Collection
from concurrent.futures import FIRST_COMPLETED, Future, wait

from jkv.store.index import Hit
from jkv.store.priority import lower_thread_priority

log = logging.getLogger(__name__)


class ReadAhead:
    """Loads hits with `load` on a daemon thread (a tier that hangs must not keep the process
    from exiting), at most `max_bytes` of them at a time (one read always may run)."""

    def __init__(self, load: Callable[[Hit], object], max_bytes: int) -> None:
        self._load = load
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        # by (entry key, blocks): the read under way or ready, the tier it was read from
        # (an entry may move while its request waits) and its chain's bytes
        self._reads: dict[tuple[str, int], tuple[Future, str, int]] = {}
        self._jobs: queue.Queue = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="jkv-store-reader",
                                        daemon=True)
        self._thread.start()

    def start(self, hit: Hit) -> bool:
        """Have `hit` loaded unless it is under way already; True once ready for `take`.
        Never waits: past the byte bound nothing new starts (False)."""
        with self._lock:
            read = self._reads.get((hit.key, hit.blocks))
            if read is None:
                held = sum(r[2] for r in self._reads.values())
                if self._closed or (self._reads and held + hit.entry_bytes > self.max_bytes):
                    return False  # no room for another read: later
                read = self._reads[hit.key, hit.blocks] = (Future(), hit.tier, hit.entry_bytes)
                self._jobs.put((read[0], hit))
        return read[0].done()

    def _work(self) -> None:
        lower_thread_priority()
        while (job := self._jobs.get()) is not None:
            future, hit = job
            if not future.set_running_or_notify_cancel():
                continue  # dropped before it started
            try:
                future.set_result(self._load(hit))
            except Exception as e:  # handed to `take`, which reports it
                future.set_exception(e)

    def take(self, hit: Hit) -> tuple[object, str] | None:
        """(`load`'s result, the tier it was read from) of a read that is done; None when
        none is (never waits). A read that raised is logged and re-raised."""
        with self._lock:
            read = self._reads.pop((hit.key, hit.blocks), None)
        if read is None or not read[0].done():
            if read is not None:
                read[0].cancel()
            return None
        try:
            return read[0].result(), read[1]
        except Exception:
            log.exception("reading stored KV entry %s failed; recomputing", hit.key)
            raise

    def wait(self, timeout: float) -> None:
        """Wait until a read is done, at most `timeout` seconds."""
        with self._lock:
            reads = [f for f, *_ in self._reads.values()]
        if reads:
            wait(reads, timeout, return_when=FIRST_COMPLETED)

    def drop(self, keep: Collection[Hit]) -> None:
        """Forget the reads of hits not in `keep`: their bytes are freed, a read not started
        is cancelled."""
        wanted = {(h.key, h.blocks) for h in keep}
        with self._lock:
            for k in [k for k in self._reads if k not in wanted]:
                self._reads.pop(k)[0].cancel()

    def close(self) -> None:
        """Cancel every read and stop the thread (a read under way finishes on its own)."""
        with self._lock:
            self._closed = True
            for future, *_ in self._reads.values():
                future.cancel()
            self._reads.clear()
            self._jobs.put(None)
