"""LayerKV's layer-wise offload: some layers of a slot's KV held in host memory, not pages.

Each layer of a slot is resident (its table row holds a page per block) or offloaded: the
contents of its own full pages sit on the host (`HostLayer`) and its row keeps only the
leading blocks it shares with the prefix cache (the cache holds those pages anyway). A
prompt can then be prefilled while the pool holds only some of its layers (LayerKV 3.3):
the pool is the send buffer. A step over a row with offloaded layers brings each such
layer's pages in just before the layer runs (`bring`: pages taken, the host copy written
into them) and sends them out after it (`send`: the new full pages copied to the host, the
pages freed), so at any moment the step holds one offloaded layer's pages beyond the
resident ones. `fetch` brings an idle slot's layers back for good (before its decode steps,
which would otherwise move every offloaded layer each step), `offload` pushes an idle slot's
layers out. `resident_layers` spreads the resident layers evenly over the depth (LayerKV
3.3: the copy out of an offloaded layer runs while the resident layer after it computes).

The page counts are the manager's (`KVCacheManager.offloaded`, `pages_held`): every call
here changes the host count of free pages by exactly what it frees or takes.

Host copies are numpy arrays; a layer brought in with the same blocks twice (decode steps
between two filled blocks, not a prefill's chunks, each of which adds blocks) also keeps a
copy in pinned host memory (`HostLayer.staged`, dropped when its blocks change), since a
copy from pinned memory runs at the DMA engines' rate without holding the caller, where a
pageable numpy source is copied on the caller's thread through a staging buffer, several
times slower.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from jkv.averages import moving_average
from jkv.kv.buckets import bucket
from jkv.kv.layer_pages import copy_layer_out
from jkv.kv.manager import KVCacheManager
from jkv.kv.pages import KVPages
from jkv.kv.transfer import join_leading


def resident_layers(num_layers: int, keep: int) -> np.ndarray:
    """Which of `num_layers` layers stay in the pool when `keep` of them do, spread evenly
    (8 layers, keep 4: layers 1, 3, 5 and 7), as bool [num_layers]."""
    if not 0 <= keep <= num_layers:
        raise ValueError(f"keep must be in 0..{num_layers}, got {keep}")
    i = np.arange(num_layers)
    return (i + 1) * keep // num_layers > i * keep // num_layers


@dataclass
class HostLayer:
    """One offloaded (slot, layer): the slot's table keeps blocks [0, first) of it (shared
    with the prefix cache), the host holds its own full blocks from `first` on: `blocks` of
    them, in `pages` (host arrays [capacity, KV heads, ...], grown by doubling)."""

    first: int
    pages: KVPages | None = None
    blocks: int = 0
    # copies on their way to the host: (index of its first block, blocks, device pages)
    pending: list[tuple[int, int, KVPages]] = field(default_factory=list)
    staged: KVPages | None = None  # `pages` in pinned host memory, while they are current
    brought: int = -1  # `blocks` when it was last brought in

    def add(self, index: int, count: int, pages: KVPages) -> None:
        """Blocks [index, index + count) are `pages`[:count] (device arrays being copied)."""
        for x in pages.arrays().values():
            x.copy_to_host_async()
        self.pending.append((index, count, pages))
        self.blocks = max(self.blocks, index + count)

    def settle(self) -> None:
        """Write the copies on their way into `pages` (a staged copy is then out of date)."""
        if self.pending:
            self.staged = None
        for index, count, part in self.pending:
            part = jax.device_get(part)
            if self.pages is None or self.pages.k.shape[0] < self.blocks:
                size = bucket(self.blocks)
                grown = jax.tree.map(lambda x, n=size: np.zeros((n, *x.shape[1:]), x.dtype),
                                     part)
                if self.pages is not None:
                    old = self.pages.k.shape[0]
                    grown = jax.tree.map(lambda g, x, m=old: _put(g, 0, x[:m]), grown,
                                         self.pages)
                self.pages = grown
            self.pages = jax.tree.map(lambda g, x, i=index, n=count: _put(g, i, x[:n]),
                                      self.pages, part)
        self.pending = []

    def host(self) -> KVPages:
        """Its blocks as host arrays [blocks, KV heads, ...] (copies settled)."""
        self.settle()
        return jax.tree.map(lambda x: x[:self.blocks], self.pages)

    @property
    def nbytes(self) -> int:
        return 0 if self.pages is None else self.pages.nbytes * self.blocks // len(self.pages.k)


def device_memory(mesh: Mesh | None = None) -> Sharding:
    """The default device's own memory (every copy in lands there, committed, so the
    jitted calls see one kind of input whichever way it came); with a tensor-parallel
    `mesh`, every device's of it, whole on each."""
    dev = jax.devices()[0]
    if mesh is not None:
        return NamedSharding(mesh, PartitionSpec(), memory_kind=dev.default_memory().kind)
    return SingleDeviceSharding(dev, memory_kind=dev.default_memory().kind)


def pinned_host(mesh: Mesh | None = None) -> Sharding | None:
    """Pinned host memory of the default device (of every device of `mesh`), where a copy
    from it to the device works; None where the backend has none."""
    pinned = (SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host") if mesh is None
              else NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host"))
    try:
        probe = jax.device_put(np.zeros(1, np.uint8), pinned)
        jax.block_until_ready(jax.device_put(probe, device_memory(mesh)))
    except (ValueError, RuntimeError):  # JaxRuntimeError is a RuntimeError
        return None
    return pinned


def _put(dest: np.ndarray, index: int, src: np.ndarray) -> np.ndarray:
    dest[index:index + len(src)] = src
    return dest


def check_reservations(oks: list[jax.Array]) -> None:
    """RuntimeError unless every page reservation a step or a fetch made on the device
    succeeded (the host count said it would)."""
    if not all(jax.device_get(oks)):
        raise RuntimeError("page reservation failed although the host count allowed it")


def settle_host_copies(offloaded: dict[int, dict[int, object]]) -> None:
    """Every offloaded layer's copies on their way out, written into its host copy."""
    for held in offloaded.values():
        for host in held.values():
            host.settle()


class LayerOffload:
    """Moves layers of a block-pages `KVCacheManager`'s slots between its pool and the host
    (the rows layout has its own: `row_layer_offload.RowLayerOffload`)."""

    layer_major = True  # a prompt can be fed a layer at a time (`jkv.engine.layer_major`)

    def __init__(self, cache: KVCacheManager) -> None:
        self.cache = cache
        self.offloaded_bytes = 0  # copied to the host, over the engine's life
        self.fetched_bytes = 0  # copied back into the pool
        self.offload_bytes_per_s = 0.0  # measured copy rate out of the pool (LayerKV eq. 4)
        self._unchecked: list[jax.Array] = []  # a step's reservation flags, read by `settle`
        heads = cache.num_kv_heads  # what a layer with nothing on the host brings in
        self._empty = jax.tree.map(lambda x: np.zeros((heads, *x.shape[1:]), x.dtype),
                                   cache.pool)  # one block, joined
        mesh = cache.placement.mesh
        self.device = device_memory(mesh)
        # None: brings copy from the numpy arrays. On CPU the device's memory is host memory:
        # a staged copy there is brought without any copy (pinned memory would be copied)
        self.staging = self.device if jax.default_backend() == "cpu" else pinned_host(mesh)
        # host copies sent ahead of their layer's turn, by (slot, layer), and how many
        # brings found theirs so
        self._ahead: dict[tuple[int, int], KVPages] = {}
        self.prefetched = 0
        # host seconds spent in the step's hooks and after it (a copy that holds the caller
        # shows here; the device's own time does not)
        self.host_seconds = {"bring": 0.0, "send": 0.0, "settle": 0.0}

    def layers(self, slot: int) -> list[int]:
        """The offloaded layers of `slot`."""
        return sorted(self.cache.offloaded.get(slot, {}))

    # ------------------------------------------------------------------ idle slots

    def offload(self, slot: int, layers: Sequence[int]) -> int:
        """Move `slot`'s `layers` (those still resident) to the host, freeing their own
        pages; returns the pages freed. The slot must not be mid-restore (the connector
        writes its queue first)."""
        c = self.cache
        self.flush()
        layers = [int(x) for x in layers if int(x) not in c.offloaded.get(slot, {})]
        bad = [x for x in layers if not 0 <= x < c.num_layers]
        if bad:
            raise ValueError(f"layers must be in 0..{c.num_layers - 1}, got {bad}")
        if not layers:
            return 0
        tokens = len(c.slot_tokens[slot])
        hosts = {layer: HostLayer(len(c.shared_rows(slot))) for layer in layers}
        compiled, t0, before = (copy_layer_out._cache_size(), time.perf_counter(),
                                self.offloaded_bytes)
        for layer, h in hosts.items():
            self._copy_out(c.pool, slot, layer, h, tokens // c.page_size)
        for h in hosts.values():  # on the host now: the copy timed (a compile is not a rate)
            h.settle()
        if copy_layer_out._cache_size() == compiled and self.offloaded_bytes > before:
            rate = (self.offloaded_bytes - before) / max(time.perf_counter() - t0, 1e-9)
            self.offload_bytes_per_s = moving_average(self.offload_bytes_per_s, rate)
        return c.layout.hold_on_host(slot, hosts)

    def before_close(self, slot: int) -> None:
        """Nothing: a slot's offloaded layers go with it (their shared blocks stay cached)."""

    def pages_to_fetch(self, slot: int) -> int:
        """Pages `fetch(slot)` takes."""
        c = self.cache
        return c.layer_own_pages(slot) * len(c.offloaded.get(slot, ()))

    def fetch(self, slot: int) -> None:
        """Bring every offloaded layer of `slot` back into the pool. RuntimeError when the
        pages cannot be had (check `pages_to_fetch` against `available_pages` first)."""
        c = self.cache
        if self.pages_to_fetch(slot) > c.available_pages:
            raise RuntimeError(f"fetching the layers of slot {slot} needs "
                               f"{self.pages_to_fetch(slot)} pages and only "
                               f"{c.available_pages} can be had")
        self.flush()
        for layer in self.layers(slot):
            self._copy_in(None, slot, layer, len(c.slot_tokens[slot]))
        c.all_resident(slot)
        self._check()

    # ------------------------------------------------------------------ inside a step

    def bring(self, slot: int, layer: int, tokens: int, pool: KVPages) -> KVPages:
        """Before layer `layer` of a step after which `slot` holds `tokens` tokens: its
        pages for all of them, the host copy written in (from pinned memory where there is
        some: the next step brings it again); returns the pool."""
        t0 = time.perf_counter()
        ahead = self._ahead.pop((slot, layer), None)
        self.prefetched += ahead is not None
        pool = self._copy_in(pool, slot, layer, tokens, stage=True, pages=ahead)
        self.host_seconds["bring"] += time.perf_counter() - t0
        return pool

    def prefetch(self, slot: int, index: int) -> None:
        """After layer `index` of a step has been dispatched: the host copy of `slot`'s next
        offloaded layer on its way to the device while the layers before it compute
        (LayerKV's layer-by-layer read ahead; `bring` takes it)."""
        t0 = time.perf_counter()
        held = self.cache.offloaded.get(slot, {})
        later = min((x for x in held if x > index), default=None)
        if later is not None and (slot, later) not in self._ahead:
            self._ahead[slot, later] = self._on_device(held[later], stage=True)
        self.host_seconds["bring"] += time.perf_counter() - t0

    def send(self, slot: int, layer: int, tokens: int, pool: KVPages) -> None:
        """After layer `layer` of that step: its new full pages copied out, its own pages
        freed (the host copy now holds every full block of it): dropped by the next bring's
        call, or by `flush`."""
        t0 = time.perf_counter()
        c = self.cache
        self._copy_out(pool, slot, layer, c.offloaded[slot][layer], tokens // c.page_size)
        c.layout.layer_sent(slot, layer, tokens)
        self.host_seconds["send"] += time.perf_counter() - t0

    def step_hooks(self, lengths: dict[int, int], stage: Callable | None,
                   plan: None = None) -> tuple:
        """Layer hooks for a step's rows with offloaded layers (`lengths`: their slots and
        lengths after the step), after `stage` (a restore's): each such layer's pages brought
        in before it runs and sent out after (the pool as LayerKV's send buffer), its host
        copy sent ahead once the layer before it is dispatched."""
        c, last = self.cache, self.cache.num_layers - 1

        def before(index: int, pool, table_pages, tiers):
            if stage is not None:  # (writes into pages reserved at open: no reservation)
                pool, table_pages, tiers = stage(index, pool, table_pages, tiers)
            moved = False
            for slot, n in lengths.items():
                if index in c.offloaded[slot]:
                    pool, moved = self.bring(slot, index, n, pool), True
            return pool, c.tables.pages if moved else table_pages, tiers

        def after(index: int, pool, table_pages, tiers):
            for slot, n in lengths.items():
                if index in c.offloaded[slot]:
                    self.send(slot, index, n, pool)  # its pages dropped by the next bring
                self.prefetch(slot, index)  # the next offloaded layer, while this computes
            moved = index == last and self.flush()  # (no bring after the last layer)
            return pool, c.tables.pages if moved else table_pages, tiers

        return before, after

    def flush(self) -> bool:
        """Drop the pages of layers sent out and not yet dropped (before anything else
        reserves pages); whether there were any."""
        return self.cache.layout.drop_sent()

    def step_pages(self, lengths: dict[int, int]) -> int:
        """The most pages a step's `bring`s hold at once: one layer's of every row with that
        layer offloaded (`lengths`: the rows' slots and their lengths after the step)."""
        c = self.cache
        per_layer = np.zeros(c.num_layers, np.int64)
        for slot, n in lengths.items():
            per_layer[list(c.offloaded.get(slot, ()))] += c.layer_own_pages(slot, n)
        return int(per_layer.max(initial=0))

    def settle(self) -> None:
        """After a step: the copies it sent are written into the host copies (the device
        arrays are freed), and its reservations checked."""
        t0 = time.perf_counter()
        self._ahead.clear()  # (a step cut short leaves some)
        self.flush()
        self._check()
        settle_host_copies(self.cache.offloaded)
        self.host_seconds["settle"] += time.perf_counter() - t0

    def _check(self) -> None:
        oks, self._unchecked = self._unchecked, []
        check_reservations(oks)

    def warmup(self) -> None:
        """Compile the copies for every power-of-two block count a row can hold, on the
        scratch slot (nothing taken, nothing written), so an offload never compiles."""
        c = self.cache
        slot, zero = np.int32(c.scratch), np.int32(0)
        empty = []
        for count in sorted({bucket(n) for n in range(1, c.max_pages + 1)}):
            copy_layer_out(c.pool, c.tables, slot, zero, zero, count=count)
            pages = jax.tree.map(lambda x, n=count: np.zeros((n * len(x), *x.shape[1:]),
                                                             x.dtype), self._empty)
            empty.append(jax.device_put(pages, self.device))
        c.layout.warmup_layer_moves(empty, c.scratch)
        jax.block_until_ready(c.pool)

    # ------------------------------------------------------------------ copies

    def _copy_out(self, pool: KVPages, slot: int, layer: int, h: HostLayer,
                  full: int) -> None:
        """Queue blocks [first + h.blocks, full) of (slot, layer) for `h` (device copies on
        their way to the host: one gather, a power-of-two of columns)."""
        c = self.cache
        start = h.first + h.blocks
        n = full - start
        if n <= 0:
            return
        pages = copy_layer_out(pool, c.tables, np.int32(slot), np.int32(layer),
                               np.int32(start), count=bucket(n))
        h.add(h.blocks, n, pages)
        self.offloaded_bytes += pages.nbytes * n // bucket(n)

    def _on_device(self, h: HostLayer, stage: bool) -> KVPages:
        """`h`'s host copy on its way to the device (the copy dispatched, not awaited, from
        pinned memory where there is a current pinned copy). `stage`: make one if the
        blocks have not changed since the last bring (decode steps between two filled
        blocks), not while every bring finds new ones (a prefill's chunks)."""
        h.settle()
        stage = stage and h.brought == h.blocks
        h.brought = h.blocks
        if h.pages is None:
            return jax.device_put(self._empty, self.device)
        if self.staging is not None and (stage or h.staged is not None):
            if h.staged is None:
                h.staged = jax.device_put(join_leading(h.pages, 2), self.staging)
            return jax.device_put(h.staged, self.device)
        return jax.device_put(join_leading(h.pages, 2), self.device)

    def _copy_in(self, pool: KVPages | None, slot: int, layer: int, tokens: int,
                 stage: bool = False, pages: KVPages | None = None) -> KVPages:
        """Have the manager give (slot, layer) the pages to hold `tokens` tokens and write
        its host copy into them (one call, `BlockPages.bring_layer`; `pages`: that copy
        already on its way, else sent now, `_on_device`); returns the pool (`pool` None:
        the manager's own)."""
        h = self.cache.offloaded[slot][layer]
        if pages is None:
            pages = self._on_device(h, stage)
        pool, ok = self.cache.layout.bring_layer(slot, layer, tokens, h.blocks, pages, pool)
        self.fetched_bytes += h.nbytes
        self._unchecked.append(ok)
        return pool
