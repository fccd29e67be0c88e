"""LayerKV's layer offload for tiered rows (the engine holds it or `LayerOffload`): layers of
idle slots moved to the host and back, and a step's hooks over rows with layers out, each
brought in for its turn, placed by the token policy there and sent out again (the moves
themselves: `row_moves`)."""

from __future__ import annotations

import time

import numpy as np

from jkv.kv.layer_offload import check_reservations, settle_host_copies
from jkv.kv.manager import KVCacheManager
from jkv.kv.tier_step import Placement


class RowLayerOffload:
    """`LayerOffload`'s part for tiered rows (the engine holds one or the other): layers of
    idle slots moved out and back, and a step's hooks over rows with layers out."""

    layer_major = False  # a tier policy places a prompt per chunk, through every layer

    def __init__(self, cache: KVCacheManager) -> None:
        self.cache, self.moves = cache, cache.layout.moves
        self.offloaded_bytes = 0
        self.fetched_bytes = 0
        self.offload_bytes_per_s = 0.0
        self.prefetched = 0
        self.host_seconds = {"bring": 0.0, "send": 0.0, "settle": 0.0}

    def layers(self, slot: int) -> list[int]:
        return sorted(self.cache.offloaded.get(slot, {}))

    def offload(self, slot: int, layers: list[int]) -> int:
        """Move `slot`'s `layers` (those still resident) to the host; the pages freed."""
        c = self.cache
        layers = [int(x) for x in layers if int(x) not in c.offloaded.get(slot, {})]
        bad = [x for x in layers if not 0 <= x < c.num_layers]
        if bad:
            raise ValueError(f"layers must be in 0..{c.num_layers - 1}, got {bad}")
        before = c.free_pages
        for layer in layers:
            self.offloaded_bytes += self.moves.send(slot, layer).nbytes
        return c.free_pages - before

    def pages_to_fetch(self, slot: int) -> int:
        c = self.cache
        return int(c.layout.layer_pages(slot)[self.layers(slot)].sum())

    def fetch(self, slot: int) -> None:
        """Bring every offloaded layer of `slot` back (RuntimeError when the pages cannot
        be had: check `pages_to_fetch` against `available_pages` first)."""
        c = self.cache
        need = self.pages_to_fetch(slot)
        if need > c.available_pages or not c.make_room(need):
            raise RuntimeError(f"fetching the layers of slot {slot} needs {need} pages and "
                               f"only {c.available_pages} can be had")
        for layer, host in list(c.offloaded.get(slot, {}).items()):
            self.moves.bring(slot, layer)
            self.fetched_bytes += host.nbytes
        self.moves.resident(slot)
        self._check()

    def before_close(self, slot: int) -> None:
        """A row is kept whole in the pool: its layers come back first where there is room
        (else it is not kept)."""
        if self.cache.offloaded.get(slot) and (self.pages_to_fetch(slot)
                                               <= self.cache.available_pages):
            self.fetch(slot)

    def step_hooks(self, lengths: dict[int, int], stage: object,
                   plan: Placement | None = None) -> tuple:
        """Hooks for a step's rows with offloaded layers (`lengths`: their slots): each such
        layer brought in before it runs, placed (`plan`, on it alone) and sent out after."""
        c, layout = self.cache, self.cache.layout

        def out_here(index: int) -> list[int]:
            return [s for s in lengths if index in c.offloaded[s]]

        def before(index: int, pool, table_pages, tiers):
            if stage is not None:
                pool, table_pages, tiers = stage(index, pool, table_pages, tiers)
            t0, slots = time.perf_counter(), out_here(index)
            meta = tiers[0]
            for slot in slots:
                self.fetched_bytes += c.offloaded[slot][index].nbytes
                pool, meta = self.moves.bring(slot, index, pool, meta)
            self.host_seconds["bring"] += time.perf_counter() - t0
            return (pool, c.tables.pages if slots else table_pages, (meta, *tiers[1:]))

        def after(index: int, pool, table_pages, tiers):
            t0, slots = time.perf_counter(), out_here(index)
            if not slots:
                return pool, table_pages, tiers
            meta = tiers[0]
            if plan is not None:
                live = np.isin(plan.index, slots)[:, None] & (
                    np.arange(c.num_layers) == index)[None]
                pool, meta = layout.place(plan, live, pool, meta)
            for slot in slots:
                self.offloaded_bytes += self.moves.send(slot, index, pool, meta).nbytes
            self.host_seconds["send"] += time.perf_counter() - t0
            return pool, c.tables.pages, (meta, layout.counts, *tiers[2:])

        return before, after

    def flush(self) -> bool:
        return False

    def step_pages(self, lengths: dict[int, int]) -> int:
        """The most pages a step's brings hold at once: one layer's of every row with that
        layer offloaded, its growth in the step included."""
        c = self.cache
        per_layer = np.zeros(c.num_layers, np.int64)
        for slot, n in lengths.items():
            layers = self.layers(slot)
            grow = c.cost.grow(len(c.slot_tokens[slot]), n - len(c.slot_tokens[slot]))
            per_layer[layers] += c.layout.layer_pages(slot)[layers] + grow // c.num_layers
        return int(per_layer.max(initial=0))

    def settle(self) -> None:
        """After a step: its copies on the host, its brings checked."""
        t0 = time.perf_counter()
        self._check()
        settle_host_copies(self.cache.offloaded)
        self.host_seconds["settle"] += time.perf_counter() - t0

    def _check(self) -> None:
        oks, self.moves.oks = self.moves.oks, []
        check_reservations(oks)

    def warmup(self) -> None:
        """Compile a send and a bring on the empty scratch slot (nothing held, nothing
        taken)."""
        c = self.cache
        self.moves.send(c.scratch, 0)
        self.moves.bring(c.scratch, 0)
        self.moves.resident(c.scratch)
        self._check()
