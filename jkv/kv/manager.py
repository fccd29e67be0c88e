"""The KV cache manager: the page pool and everything that says who holds which page.

One owner of the page budget and the only writer of device KV state, with the layout it
composes: how a sequence's KV sits in the pool (`layouts.py`: block pages, or a token
policy's per-head tiers). It holds the pool (`KVPages`), the filling pages, the free list
with its reference counts and the page tables (`allocator`) and the sequence slots with the
tokens each holds; the layout holds what is its own (the prefix cache's blocks, or the tiers
and kept rows). The engine asks it for room before a step; the scheduler's plan asks its
`cost` how many pages tokens take; neither computes page counts another way.

A host count of free pages mirrors the device free list so that planning never waits for
the device: pages change hands only here and in the layout, so which pages a release frees
is known exactly (token tiers' placements are read back once per step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.sharding import Mesh

from jkv.kv.allocator import init_free, init_tables
from jkv.kv.buckets import bucket
from jkv.kv.format import KVFormat
from jkv.kv.kv_state import KVState, read_only
from jkv.kv.layout import Layout
from jkv.kv.layouts import TierPolicy, layout_class, make_layout
from jkv.kv.page_cost import PageCost
from jkv.kv.page_pool import init_filling, page_bytes
from jkv.kv.pages import KVPages
from jkv.kv.prefix_cache import block_hashes
from jkv.kv.sharding import KVPlacement
from jkv.kv.transfer import scatter_pages, slot_page_ids


@dataclass
class FinishedKV:
    """What ended sequences held as they ended: the sum over them of the pool's bytes per
    token of context, and their tokens per tier, summed over (layer, KV head)."""

    sequences: int = 0
    bytes_per_token: float = 0.0
    tokens: dict = field(default_factory=lambda: dict.fromkeys(
        ("high", "low", "pruned", "window"), 0))


class KVCacheManager:
    """Pages, tables and slots of one engine and their layout: the only writer of device KV
    state. Other parts read it through the properties below and change it through the
    methods (`open`, `grow`, `close`, `run_model`, `write_pages`, the layout's own);
    assigning to a property raises AttributeError."""

    pool = read_only("_s", "pool", "The page pool (`KVPages`).")
    filling = read_only("_s", "filling", "The pages being filled, beside the pool.")
    free = read_only("_s", "free", "The device free list (`allocator.FreeList`).")
    tables = read_only("_s", "tables", "The slots' page tables (`allocator.PageTables`).")
    free_pages = read_only("_s", "free_pages", "Host mirror of the device's free count.")
    offloaded = read_only("_s", "offloaded", "slot -> {layer: its host copy} (LayerKV).")
    slot_tokens = read_only("_s", "slot_tokens", "The token ids whose KV each slot holds.")

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype,
                 kv_format: KVFormat, page_size: int, kv_cache_bytes: int, max_model_len: int,
                 max_num_seqs: int, enable_prefix_caching: bool,
                 device_cache_bytes: int | None, hash_seed: bytes,
                 tiers: TierPolicy | None = None,
                 mesh: Mesh | None = None) -> None:
        """`mesh`: a tensor-parallel mesh to split the KV state over by KV head
        (`kv_cache_bytes` then the total over its devices; None: the default device)."""
        kind = layout_class(tiers)
        self.placement = placement = KVPlacement(mesh)
        groups = placement.groups
        self.page_size, self.max_model_len = page_size, max_model_len
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.cost = PageCost(page_size, num_layers * num_kv_heads, on_fill=kind.pages_on_fill,
                             layers=num_layers)
        self.one_page = one_page = page_bytes(kv_format, page_size, head_dim, dtype)
        num_pages = kv_cache_bytes // one_page // groups * groups  # equal parts per group
        self.max_pages = kind.table_width(-(-max_model_len // page_size))
        one_seq = self.cost.pages(max_model_len)
        if num_pages - groups < one_seq:
            raise ValueError(
                f"kv_cache_bytes={kv_cache_bytes} holds {num_pages} pages but one "
                f"sequence of max_model_len={max_model_len} needs {one_seq}; raise "
                f"kv_cache_bytes to at least {(-(-one_seq // groups) + 1) * groups * one_page} "
                f"or lower "
                f"max_model_len")
        self.total_pages = num_pages - groups  # page 0 is the null page (and each group's 1st)
        slots = max_num_seqs + 1  # the last slot is scratch for padding rows
        self.max_num_seqs, self.scratch = max_num_seqs, max_num_seqs
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed = hash_seed + kind.seed_tag(tiers)
        # the token policy placing its tokens ("none": block pages, whatever the policy)
        self.token_policy = "none" if tiers is None else tiers.name
        device = placement.replicated
        s = self._s = KVState()
        s.free_pages = self.total_pages  # host mirror of free.num_free
        # committed like the step's outputs, so the first call compiles what later ones reuse
        s.pool = placement.make(lambda: KVPages.zeros(num_pages, page_size, head_dim, dtype,
                                                      kv_format), placement.pages)
        s.filling = placement.make(lambda: init_filling(
            slots, num_layers, num_kv_heads, page_size, head_dim, dtype, kind.filling_scores),
            placement.heads(2))
        free = (init_free(num_pages, page_size) if groups == 1 else
                init_free(num_pages, page_size, groups, num_kv_heads // groups))
        s.free = jax.device_put(free, device)
        s.tables = jax.device_put(init_tables(slots, num_layers, num_kv_heads,
                                              self.max_pages), device)
        s.slot_tokens = [[] for _ in range(max_num_seqs)]
        shared = dict(cost=self.cost, page_size=page_size, max_pages=self.max_pages,
                      total_pages=self.total_pages, one_page=one_page,
                      enable_prefix_caching=enable_prefix_caching,
                      device_cache_bytes=device_cache_bytes, hash_seed=hash_seed,
                      max_num_seqs=max_num_seqs, placement=placement)
        self.layout: Layout = make_layout(s, tiers, max_model_len, **shared)
        self.finished = FinishedKV()
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))

    # ------------------------------------------------------------------ the budget

    @property
    def block_pages(self) -> int:
        """Pages one block (page_size tokens of one sequence) takes."""
        return self.cost.heads

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def available_pages(self) -> int:
        """Pages a new allocation can have: free ones plus those the layout keeps for reuse
        and can evict (unreferenced cached blocks, kept rows)."""
        return self.free_pages + self.layout.evictable_pages

    @property
    def pages_used(self) -> int:
        """Pages held by running sequences and kept for reuse (cached blocks, kept rows)."""
        return self.total_pages - self.free_pages

    @property
    def pages_cached(self) -> int:
        """Pages kept for reuse: the prefix cache's blocks or the kept rows."""
        return self.layout.cached_pages

    def resident(self, slot: int) -> int:
        """Layers of `slot` whose pages are in the pool (the others: `offloaded`)."""
        return self.num_layers - len(self.offloaded.get(slot, ()))

    @property
    def lossy_recompute(self) -> bool:
        """Whether a sequence's KV recomputed from its tokens can differ from what it holds:
        a token policy's rows (placed per prompt chunk, not as decode steps placed them), or
        keys quantized per page and channel (a page filled token by token is scaled as it
        grows, a recomputed one at once)."""
        f = self.pool.kv_format
        return self.layout.lossy_recompute or f.page_keys

    def shared_rows(self, slot: int) -> list[int]:
        """The prefix-cache rows `slot` started from (its first blocks' pages)."""
        return self.layout.shared_rows(slot)

    def pages_to_grow(self, slot: int, num_tokens: int) -> int:
        """New pages `slot` needs to hold `num_tokens` more tokens (in its resident layers)."""
        grow = self.cost.grow(len(self.slot_tokens[slot]), num_tokens)
        return grow // self.num_layers * self.resident(slot)

    def layer_own_pages(self, slot: int, tokens: int | None = None) -> int:
        """Pages one layer of `slot` holds past the blocks it shares with the prefix cache,
        when it holds `tokens` tokens (default: those it holds; the most of any layer where
        layers hold different numbers)."""
        return self.layout.layer_own_pages(slot, tokens)

    def pages_offloadable(self, slot: int) -> int:
        """Pages offloading every resident layer of `slot` frees (its own, not shared)."""
        return self.layout.pages_offloadable(slot)

    def pages_held(self, slot: int) -> int:
        """Pages of the pool `slot` holds (shared ones included)."""
        return self.layout.pages_held(slot)

    def pages_freed_by_close(self, slot: int) -> int:
        """How much `available_pages` grows when `close(slot)` runs."""
        return self.layout.pages_freed_by_close(slot)

    def prompt_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Block hashes of the part of a prompt that could come from the prefix cache or the
        store (all full blocks but the last token: that one is always computed, for its
        logits)."""
        n = (len(token_ids) - 1) // self.page_size
        return block_hashes(token_ids, self.page_size, self.hash_seed, n)

    def cached_block_hashes(self) -> list[bytes]:
        """The block hashes the device prefix cache holds (none under token tiers, whose
        kept rows are found whole)."""
        prefix = getattr(self.layout, "prefix", None)
        return [] if prefix is None else prefix.keys()

    def lookup(self, hashes: Sequence[bytes]) -> tuple[int, int]:
        """(tokens found in the prefix cache or, with token tiers, a kept sequence, pages
        that opening the sequence would take from `available_pages`: cached blocks no one
        else holds, or a copy of the kept sequence). No side effects."""
        return self.layout.lookup(hashes)

    def make_room(self, pages: int) -> bool:
        """Evict what the layout keeps for reuse (least recently used first) until `pages`
        pages are free; False if that cannot be done."""
        return self.layout.make_room(pages)

    def _finished(self, slot: int) -> None:
        """What `slot` holds as it ends, into `finished`."""
        n = len(self.slot_tokens[slot])
        if not n:
            return
        f = self.finished
        f.sequences += 1
        f.bytes_per_token += self.pages_held(slot) * self.one_page / n
        heads = self.cost.heads
        window = (n % self.page_size) * heads
        kept = self.layout.tier_tokens(slot, n)
        for tier, count in kept.items():
            f.tokens[tier] += count
        f.tokens["pruned"] += n * heads - window - sum(kept.values())
        f.tokens["window"] += window

    # ------------------------------------------------------------------ slots

    def is_open(self, slot: int) -> bool:
        return 0 <= slot < self.max_num_seqs and slot not in self._free_slots

    def open(self, token_ids: Sequence[int], use_prefix_cache: bool = True,
             max_cached: int | None = None, prompt_tokens: int | None = None
             ) -> tuple[int, int]:
        """Take a free slot for `token_ids`, whose prompt is the first `prompt_tokens`
        (default all); returns (slot, tokens found in the prefix cache or, with token tiers,
        in a kept sequence, which the slot now holds; 0 without `use_prefix_cache`, at most
        `max_cached`)."""
        if prompt_tokens is not None and not 1 <= prompt_tokens <= len(token_ids):
            raise ValueError(f"prompt_tokens must be in 1..{len(token_ids)} (the tokens opened), "
                             f"got {prompt_tokens}")
        if not self._free_slots:
            raise RuntimeError("no free sequence slot")
        slot = self._free_slots.pop()
        hashes = self.prompt_hashes(token_ids) if use_prefix_cache else []
        if max_cached is not None:
            hashes = hashes[:max_cached // self.page_size]
        cached = self.layout.open(slot, hashes, len(token_ids) if prompt_tokens is None
                                  else prompt_tokens)
        self.slot_tokens[slot] = list(token_ids[:cached])
        return slot, cached

    def grow(self, new_lengths: dict[int, int], spare: int = 0) -> jax.Array:
        """Give slots the pages to hold `new_lengths[slot]` tokens in their resident
        layers (evicting cached blocks if needed), with `spare` more pages free after (what
        the step brings in of offloaded layers); returns the device's ok flag (read it with
        the step's outputs). RuntimeError when the pages cannot be had."""
        need = sum(self.pages_to_grow(s, n - len(self.slot_tokens[s]))
                   for s, n in new_lengths.items())
        if not self.make_room(need + spare):
            raise RuntimeError(f"the step needs {need + spare} KV pages and only "
                               f"{self.available_pages} can be had")
        return self.layout.grow(new_lengths, need)

    def reserve_blocks(self, slot: int, first: int, n: int) -> jax.Array | None:
        """New pages for blocks [first, n) of `slot`, which holds `first` blocks, as page
        ids [bucket(n - first), layers, KV heads] (padding: null); None when they cannot be
        had. The slot counts as holding them from now on (`add_tokens`)."""
        if n <= first or not self.layout.reserve_blocks(slot, first, n):
            return None
        return self.page_ids(slot, first, n)

    def page_ids(self, slot: int, first: int, stop: int, count: int | None = None) -> jax.Array:
        """Page ids of `slot`'s blocks [first, first + count) as [count, layers, KV heads],
        null from `stop` on; `count` defaults to bucket(stop - first)."""
        count = bucket(stop - first) if count is None else count
        return slot_page_ids(self.tables.pages, np.int32(slot), np.int32(first),
                             np.int32(stop), count=count)

    def add_tokens(self, slot: int, token_ids: Sequence[int]) -> None:
        """`slot` now holds the KV of `token_ids` too (after the step that wrote it, or a
        restore that will)."""
        self.slot_tokens[slot].extend(int(t) for t in token_ids)

    def close(self, slot: int, shareable: int, finished: bool = True,
              keep: bool = True, ahead: int = 0) -> None:
        """End the sequence in `slot`: what the layout keeps of it (its first `shareable`
        full blocks, whose KV is exactly its tokens', in the prefix cache; a row of tiers
        whole) is kept when prefix caching is on, and its other pages are freed.
        `finished` (not preempted): what it held counts in `finished`. `keep` False:
        nothing is kept. `ahead`: pages its resident layers took for a prompt they do not
        hold yet (a layer-major prefill under way), freed with it."""
        self._s.free_pages += ahead
        if finished:
            self._finished(slot)
        self.layout.close(slot, shareable, keep)
        self.offloaded.pop(slot, None)
        self.slot_tokens[slot] = []
        self._free_slots.append(slot)

    def warmup(self) -> None:
        """Compile the layout's own calls (nothing changes)."""
        self.layout.warmup()

    # ------------------------------------------------------------------ writes by the model

    def run_model(self, call: Callable) -> object:
        """Run a model call over the pool: `call(pool, filling, table_pages, tiers)` (tiers:
        the layout's `model_tiers`) returns (out, pool, filling, meta); the pool, filling
        pages and token metadata it returns become the manager's (the model writes a step's
        KV into pages the manager gave out). Returns out."""
        s = self._s
        out, s.pool, s.filling, meta = call(s.pool, s.filling, s.tables.pages,
                                            self.layout.model_tiers())
        self.layout.took_meta(meta)
        return out

    def write_pages(self, ids: jax.Array, pages: KVPages) -> None:
        """Write `pages` into the pool at page ids `ids` (a restore's loaded blocks, into
        pages `reserve_blocks` gave out)."""
        self._s.pool = scatter_pages(self.pool, ids, pages)

    def all_resident(self, slot: int) -> None:
        """Every layer of `slot` is back in the pool (the layout brought each)."""
        self.offloaded.pop(slot, None)
