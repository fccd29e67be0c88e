"""One step of work on the device: sequences in slots, their pages, the prefix cache.

The engine owns the page pool, the page tables (one row per sequence *slot*), the filling
pages and the device prefix cache. A step feeds some slots a chunk of prompt and others one
decoded token, as calls of the model runner (`jkv.runner`: compiled shapes, warmup, the only
caller of the model). `execution` says how restored KV reaches the pool: "scan" writes it
all before the step, "layerwise" layer by layer while earlier layers compute (below).
Which sequences run, and when one stops, is the scheduler's business (`jkv.scheduler`); the
engine only checks that what it is asked to do fits.

Full pages outlive their sequence when prefix caching is on: on `close` a sequence's full
blocks go to the prefix cache (`jkv.cache.prefix_cache`), and `open` starts a new sequence
from the longest cached run of its prompt's blocks.

Pages also leave the device and come back (the KV store, `jkv.store`): `gather` copies a
slot's full blocks out (dispatched, not awaited), `open(restore=SavedPages)` writes saved
blocks into new pages, all at once or, with execution="layerwise", layer by layer a read
buffer of layers ahead of the layer computing, and `rebase` moves saved blocks to other
positions for a truncated conversation. Blocks restored but not yet written, and moved
blocks (approximate KV), are never shared under their tokens' hashes.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jkv.averages import moving_average
from jkv.cache.page_pool import (
    export_blocks,
    free_pages,
    import_blocks,
    init_filling,
    init_pool,
    init_tables,
    page_bytes,
    release,
    reserve,
)
from jkv.cache.prefix_cache import PrefixCache, block_hashes
from jkv.cache.rebase import rebase_pages
from jkv.cache.transfer import FIELDS, gather_pages, scatter_pages, slot_page_ids
from jkv.config import CacheConfig, EngineConfig, ModelConfig
from jkv.models.family import ModelFamily
from jkv.models.llama import LLAMA, Params
from jkv.runner import ModelRunner, Row, bucket


def resolve_backend(name: str) -> str:
    """The attention backend `auto` means here: the Pallas kernels on a GPU, else xla."""
    if name == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return name


@dataclass
class _Restore:
    """Saved pages waiting to be written into the pool: `pages[field]` is [count, layers,
    KV heads, ...] for page ids `ids` [count, layers, KV heads] (null ids: padding)."""

    ids: np.ndarray
    pages: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.pages.values())


class Sampled(NamedTuple):
    """A row's new token, its log-probability and the most likely alternatives."""

    token: int
    logprob: float
    top_ids: np.ndarray  # int32 [MAX_LOGPROBS], most likely first
    top_logprobs: np.ndarray  # float32 [MAX_LOGPROBS]


@dataclass
class SavedPages:
    """A sequence's first `num_blocks` full blocks in the pool's format: `arrays[field]` is
    [>= num_blocks, layers, KV heads, page, ...] (`jkv.cache.transfer`), rows past
    `num_blocks` padding. Host arrays, or device arrays still being gathered (`gather`)."""

    num_blocks: int
    arrays: dict[str, np.ndarray | jax.Array]
    hashes: list[bytes]  # chained block hashes of its tokens (model, format, page size)
    # blocks from this one on hold approximate KV (moved by `Engine.rebase`): usable by the
    # prompt they were made for, never shared under their tokens' hashes
    exact_blocks: int | None = None

    def fetch(self) -> SavedPages:
        """The same blocks as host arrays of exactly `num_blocks` rows (waits for the copy)."""
        arrays = jax.device_get(self.arrays)
        return SavedPages(self.num_blocks,
                          {f: np.asarray(x)[: self.num_blocks] for f, x in arrays.items()},
                          self.hashes[: self.num_blocks], self.exact_blocks)


@dataclass
class EngineStats:
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0  # steps with prefill rows
    decode_tokens: int = 0
    decode_seconds: float = 0.0  # steps with decode rows only
    steps: int = 0
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of which found on the device
    restored_tokens: int = 0  # prompt tokens whose KV came from saved pages (`open(restore=)`)
    step_shapes: set = field(default_factory=set)  # (rows, tokens) buckets run


class Engine:
    """Runs steps over sequence slots; see `open`, `step` and `close`."""

    def __init__(self, cfg: ModelConfig, params: Params, *, cache: CacheConfig,
                 config: EngineConfig, model_id: str = "",
                 shape_step: int | None = None, family: ModelFamily = LLAMA) -> None:
        """`config` is validated where it is made; its max_model_len None means the model's
        limit (`EngineConfig.resolve_max_model_len`)."""
        max_model_len = config.resolve_max_model_len(cfg.max_position_embeddings)
        max_num_seqs, prefill_chunk = config.max_num_seqs, config.prefill_chunk
        execution, seed = config.execution, config.seed
        attention_backend = resolve_backend(config.attention_backend)
        enable_prefix_caching = config.enable_prefix_caching
        device_cache_bytes = config.device_cache_bytes
        self.config = config
        self.cfg, self.params = cfg, params
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.prefill_chunk = prefill_chunk
        self.page_size = cache.page_size
        dtype = params["embed"].dtype
        one_page = page_bytes(cache.kv_format, cache.page_size, cfg.head_dim, dtype)
        num_pages = cache.kv_cache_bytes // one_page
        self.block_pages = cfg.num_layers * cfg.num_kv_heads  # pages per block of tokens
        self.max_pages = bucket(-(-max_model_len // cache.page_size), 4)  # table width
        one_seq = self.pages_for(max_model_len)
        if num_pages - 1 < one_seq:
            raise ValueError(
                f"kv_cache_bytes={cache.kv_cache_bytes} holds {num_pages} pages but one "
                f"sequence of max_model_len={max_model_len} needs {one_seq}; raise "
                f"kv_cache_bytes to at least {(one_seq + 1) * one_page} or lower max_model_len")
        self.total_pages = num_pages - 1  # page 0 is the null page
        self.pool, self.free = init_pool(num_pages, cache.page_size, cfg.head_dim, dtype,
                                         cache.kv_format)
        slots = max_num_seqs + 1  # the last slot is scratch for padding rows
        self.scratch = max_num_seqs
        self.filling = init_filling(slots, cfg.num_layers, cfg.num_kv_heads, cache.page_size,
                                    cfg.head_dim, dtype)
        # committed like the step's outputs, so the first call compiles what later ones reuse
        self.pool, self.filling, self.free = jax.device_put((self.pool, self.filling, self.free),
                                                            jax.devices()[0])
        self.tables = jax.device_put(
            init_tables(slots, cfg.num_layers, cfg.num_kv_heads, self.max_pages),
            jax.devices()[0])
        self.attention_backend = attention_backend
        self.execution = execution
        self.free_pages = self.total_pages  # host mirror of free.num_free
        self.runner = ModelRunner(cfg, params, family, backend=attention_backend,
                                  layer_by_layer=execution == "layerwise",
                                  max_rows=max_num_seqs, scratch_slot=self.scratch,
                                  prefill_chunk=prefill_chunk, shape_step=shape_step)

        self.enable_prefix_caching = enable_prefix_caching
        capacity = self.total_pages // self.block_pages if enable_prefix_caching else 0
        max_rows = None
        if device_cache_bytes is not None:
            max_rows = device_cache_bytes // (one_page * self.block_pages)
        self.prefix = PrefixCache(capacity, max_rows)
        self.blocks = jnp.zeros((max(capacity, 1), cfg.num_layers, cfg.num_kv_heads), jnp.int32)
        self._hash_seed = (f"{model_id}|{cache.kv_format.name}|{cache.page_size}|"
                           f"{jnp.dtype(dtype).name}|{cfg}").encode()
        self.kv_format = cache.kv_format.name
        self._format, self._dtype = cache.kv_format, dtype
        self._rotate = family.rotate_keys(cfg)
        # names the KV this engine writes (model, format, page size, shapes) in stored entries
        self.fingerprint = hashlib.blake2b(self._hash_seed, digest_size=16).hexdigest()

        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.slot_tokens: list[list[int]] = [[] for _ in range(max_num_seqs)]
        self._slot_rows: list[list[int]] = [[] for _ in range(max_num_seqs)]  # cache rows read
        self._seed, self._requests_seen = seed, 0
        self.stats = EngineStats()
        self._restores: dict[int, _Restore] = {}  # slot -> saved pages not yet written
        # slot -> first block whose KV is not its tokens' own: restored but not yet written,
        # or moved by `rebase` (approximate); such blocks are never shared under their hashes
        self._unwritten_from: dict[int, int] = {}
        self._approx_from: dict[int, int] = {}
        self.load_bytes_per_s = 0.0  # measured restore rate (host arrays into the pool)

    # ------------------------------------------------------------------ accounting

    @property
    def num_compiles(self) -> int:
        """Compiled variants of the step functions (a steady workload must not add any)."""
        return self.runner.num_compiles

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def available_pages(self) -> int:
        """Pages a new allocation can have: free ones plus unreferenced cached blocks."""
        return self.free_pages + self.prefix.num_evictable * self.block_pages

    @property
    def pages_used(self) -> int:
        """Pages held by running sequences and by the prefix cache."""
        return self.total_pages - self.free_pages

    def pages_for(self, num_tokens: int) -> int:
        """Pages one sequence of `num_tokens` tokens occupies across all layers and KV heads."""
        return -(-num_tokens // self.page_size) * self.block_pages

    def pages_to_grow(self, slot: int, num_tokens: int) -> int:
        """New pages `slot` needs to hold `num_tokens` more tokens."""
        held = len(self.slot_tokens[slot])
        return self.pages_for(held + num_tokens) - self.pages_for(held)

    def prompt_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Block hashes of the part of a prompt that could come from the prefix cache or the
        store (all full blocks but the last token: that one is always computed, for its
        logits)."""
        n = (len(token_ids) - 1) // self.page_size
        return block_hashes(token_ids, self.page_size, self._hash_seed, n)

    def lookup(self, hashes: Sequence[bytes]) -> tuple[int, int]:
        """(tokens found in the prefix cache, pages of them that opening the sequence would
        take from `available_pages` because no one else holds them). No side effects."""
        rows = self.prefix.lookup(hashes)
        return len(rows) * self.page_size, self.prefix.num_unreferenced(rows) * self.block_pages

    def pages_freed_by_close(self, slot: int) -> int:
        """How much `available_pages` grows when `close(slot)` runs."""
        held = -(-len(self.slot_tokens[slot]) // self.page_size)
        pinned = len(self._slot_rows[slot]) - self.prefix.num_sole(self._slot_rows[slot])
        return (held - pinned) * self.block_pages

    def request_key(self, seed: int | None) -> np.ndarray:
        """A request's PRNG key: from its seed, or the engine's seed and a request counter."""
        if seed is None:
            key = jax.random.fold_in(jax.random.PRNGKey(self._seed), self._requests_seen)
            self._requests_seen += 1
            return np.asarray(key, np.uint32)
        s = seed % (1 << 64)  # threefry's seeding of a 64-bit seed, done here for any int
        return np.array([s >> 32, s & 0xFFFFFFFF], np.uint32)

    def _make_room(self, pages: int) -> bool:
        """Evict cached blocks until `pages` pages are free; False if that cannot be done."""
        short = pages - self.free_pages
        if short > 0:
            rows = self.prefix.evict(-(-short // self.block_pages))
            self._free_rows(rows)
        return self.free_pages >= pages

    def _free_rows(self, rows: list[int]) -> None:
        if rows:
            ids = self.blocks[jnp.asarray(rows, jnp.int32)]
            self.free = free_pages(self.free, ids)
            self.free_pages += len(rows) * self.block_pages

    # ------------------------------------------------------------------ sequences

    def open(self, token_ids: Sequence[int],
             restore: SavedPages | None = None) -> tuple[int, int]:
        """Take a free slot for a sequence whose prompt is `token_ids`.

        Returns (slot, cached): the first `cached` tokens are already held (prefix cache
        hits, then the blocks of `restore` past them: saved pages of this prompt's first
        blocks, written into new pages); feed the rest with `step`.
        """
        if not self._free_slots:
            raise RuntimeError("no free sequence slot")
        if not 1 <= len(token_ids) < self.max_model_len:
            raise ValueError(f"a prompt needs 1..{self.max_model_len - 1} tokens, "
                             f"got {len(token_ids)}")
        if restore is not None:
            self._restorable(restore, token_ids)  # raises before anything is taken
        slot = self._free_slots.pop()
        rows = self.prefix.lookup(self.prompt_hashes(token_ids))
        if self.enable_prefix_caching:
            self.stats.prefix_query_tokens += len(token_ids)
        cached = len(rows) * self.page_size
        if rows:
            self.prefix.acquire(rows)
            padded = np.full(self.max_pages, -1, np.int32)
            padded[: len(rows)] = rows
            self.tables = import_blocks(self.tables, self.blocks, jnp.int32(slot),
                                        jnp.asarray(padded), jnp.int32(len(rows)),
                                        jnp.int32(cached))
            self.stats.prefix_hit_tokens += cached
        if restore is not None:
            cached = self._restore(slot, len(rows), restore, token_ids)
            if restore.exact_blocks is not None and cached > restore.exact_blocks * self.page_size:
                self._approx_from[slot] = max(restore.exact_blocks, len(rows))
        self.slot_tokens[slot] = list(token_ids[:cached])
        self._slot_rows[slot] = rows
        return slot, cached

    def _shareable_blocks(self, slot: int) -> int:
        """Full blocks of `slot` whose KV is exactly its tokens' (all but moved ones, and
        none past a restore that was never written)."""
        n = len(self.slot_tokens[slot]) // self.page_size
        return min(n, self._unwritten_from.get(slot, n), self._approx_from.get(slot, n))

    def _restorable(self, saved: SavedPages, token_ids: Sequence[int]) -> int:
        """Blocks of `saved` that `token_ids` can take; ValueError if they are another
        prompt's (or another model's, format's or page size's: the hashes are seeded)."""
        n = min(saved.num_blocks, (len(token_ids) - 1) // self.page_size)
        if n and saved.hashes[n - 1] != block_hashes(token_ids, self.page_size,
                                                     self._hash_seed, n)[n - 1]:
            raise ValueError("the saved pages are not this prompt's (block hashes differ)")
        pool = {f: getattr(self.pool, f) for f in FIELDS if getattr(self.pool, f) is not None}
        if sorted(saved.arrays) != sorted(pool):
            raise ValueError(f"the saved pages carry {sorted(saved.arrays)}, this pool's "
                             f"format needs {sorted(pool)}")
        for f, x in saved.arrays.items():
            want = (self.cfg.num_layers, self.cfg.num_kv_heads, *pool[f].shape[1:])
            if x.dtype != pool[f].dtype or tuple(x.shape[1:]) != want or x.shape[0] < n:
                raise ValueError(f"saved pages[{f!r}] are {x.dtype}{list(x.shape)}, this pool "
                                 f"needs {pool[f].dtype}[>={n}, {', '.join(map(str, want))}]")
        return n

    def _restore(self, slot: int, first: int, saved: SavedPages,
                 token_ids: Sequence[int]) -> int:
        """Reserve new pages of `slot` for saved blocks [first, n) (never the prompt's last
        token: it is computed for its logits) and queue their contents for writing
        (`_Restore`); returns the tokens the slot then holds."""
        n = self._restorable(saved, token_ids)
        need = self.pages_for(n * self.page_size) - self.pages_for(first * self.page_size)
        if n <= first or not self._make_room(need):
            return first * self.page_size  # nothing to add, or no room: recompute instead
        new_len = np.zeros(self.max_num_seqs + 1, np.int32)
        new_len[slot] = n * self.page_size
        self.free, self.tables, ok = reserve(self.free, self.tables, jnp.asarray(new_len))
        if not bool(ok):
            raise RuntimeError("page reservation failed although the host count allowed it")
        self.free_pages -= need
        count = bucket(n - first)
        ids = slot_page_ids(self.tables.pages, jnp.int32(slot), jnp.int32(first),
                            jnp.int32(n), count=count)
        pages = {}
        for f, x in saved.arrays.items():
            part = np.zeros((count, *x.shape[1:]), x.dtype)
            part[: n - first] = x[first:n]
            pages[f] = part
        self._restores[slot] = _Restore(np.asarray(ids), pages)
        self._unwritten_from[slot] = first  # until the pages are written (`_written`)
        if self.execution != "layerwise" or not self.load_bytes_per_s:
            self.write_restores([slot])  # at once, timed (the first one measures the rate)
        self.stats.restored_tokens += (n - first) * self.page_size
        return n * self.page_size

    def write_restores(self, slots: Sequence[int]) -> None:
        """Write the queued restores of `slots` into the pool now, every layer at once
        (layer-wise execution otherwise writes them layer by layer in the slot's next step)."""
        for slot in slots:
            r = self._restores.get(slot)
            if r is not None:
                compiled = scatter_pages._cache_size()
                t0 = time.perf_counter()
                self.pool = jax.block_until_ready(scatter_pages(self.pool, r.ids, r.pages))
                if scatter_pages._cache_size() == compiled:  # a compile is not a load rate
                    self._learn_load(r.nbytes, time.perf_counter() - t0)
                self._written([slot])

    def _written(self, slots: Sequence[int]) -> None:
        """The restores of `slots` are in the pool: their blocks are the tokens' own again."""
        for slot in slots:
            self._restores.pop(slot, None)
            self._unwritten_from.pop(slot, None)

    def _learn_load(self, nbytes: int, seconds: float) -> None:
        if seconds > 0:
            rate = nbytes / seconds
            self.load_bytes_per_s = moving_average(self.load_bytes_per_s, rate)

    def read_buffer_layers(self, load_bytes: int, new_tokens: int) -> int:
        """Layers of restored KV to have in flight ahead of the layer computing
        (CachedAttention 3.2.1): the buffer covers the gap between loading the history,
        T_load * L_hist, and prefilling the new tokens, T_pref * L_new; at least one layer.
        From measured rates; every layer until both have been measured."""
        layers = self.cfg.num_layers
        per_token = self.stats.prefill_seconds / max(self.stats.prefill_tokens, 1)
        if not self.load_bytes_per_s or not per_token:
            return layers
        gap = load_bytes / self.load_bytes_per_s - per_token * new_tokens
        buffer_bytes = self.load_bytes_per_s * max(gap, 0.0)  # S_buf = B (T_load L_hist - ...)
        return min(layers, max(1, math.ceil(buffer_bytes / (load_bytes / layers))))

    def gather(self, slot: int) -> SavedPages:
        """The full blocks `slot` holds, as device arrays being copied out of the pool: the
        copy is dispatched, not awaited, and later steps may reuse the pages (`fetch` it on
        another thread: what the store's write-behind does)."""
        self.write_restores([slot])
        n = self._shareable_blocks(slot)
        ids = slot_page_ids(self.tables.pages, jnp.int32(slot), jnp.int32(0), jnp.int32(n),
                            count=bucket(n))
        return SavedPages(n, gather_pages(self.pool, ids),
                          block_hashes(self.slot_tokens[slot], self.page_size, self._hash_seed))

    def rebase(self, saved: SavedPages, token_ids: Sequence[int], keep: int,
               drop: int) -> SavedPages:
        """Saved pages of a sequence U moved for the prompt `token_ids` = U[:keep] +
        U[keep + drop:] (a conversation whose oldest turns after its first `keep` tokens
        were dropped): the tokens after `keep` move `drop` positions earlier, their keys
        re-rotated (CachedAttention 3.4). Returns the prompt's full blocks that the saved
        tokens cover (never its last token), hashed as the prompt's own; no blocks if none.
        Their KV is the KV those tokens had in U: attention saw the dropped turns."""
        if keep < 0 or drop < 0:
            raise ValueError(f"keep and drop must be >= 0, got {keep} and {drop}")
        ps = self.page_size
        m = min((saved.num_blocks * ps - drop) // ps, (len(token_ids) - 1) // ps)
        if m <= 0:
            return SavedPages(0, {}, [])
        t = np.arange(bucket(m) * ps)
        moved = t >= keep
        src = np.where(t < m * ps, t + drop * moved, 0).astype(np.int32)
        shift = np.where(moved, -drop, 0).astype(np.int32)
        rows = bucket(saved.num_blocks)
        pages = {}
        for f, x in saved.arrays.items():
            padded = np.zeros((rows, *x.shape[1:]), x.dtype)
            padded[: saved.num_blocks] = np.asarray(x)[: saved.num_blocks]
            pages[f] = padded
        out = rebase_pages(pages, src, shift, fmt=self._format,
                           group=min(self._format.group, self.cfg.head_dim), dtype=self._dtype,
                           rotate=self._rotate)
        return SavedPages(m, jax.device_get(out), self.prompt_hashes(token_ids)[:m],
                          exact_blocks=min(m, keep // ps))

    def save_pages(self, slot: int) -> SavedPages:
        """The full blocks `slot` holds, copied to the host."""
        return self.gather(slot).fetch()

    def close(self, slot: int) -> None:
        """End the sequence in `slot`: its full blocks go to the prefix cache (when on) and
        its other pages back to the pool."""
        self._restores.pop(slot, None)  # never written (the request ended first)
        tokens, shared = self.slot_tokens[slot], self._slot_rows[slot]
        shareable = max(self._shareable_blocks(slot), len(shared))
        self._unwritten_from.pop(slot, None)
        self._approx_from.pop(slot, None)
        keep = np.zeros((self.max_num_seqs + 1, self.max_pages), bool)
        keep[slot, : len(shared)] = True
        if self.enable_prefix_caching:
            self.prefix.release(shared)
            hashes = block_hashes(tokens, self.page_size, self._hash_seed, shareable)
            dest = np.full(self.max_pages, -1, np.int32)
            for i in range(len(shared), len(hashes)):
                row, evicted = self.prefix.insert(hashes[i], i)
                self._free_rows(evicted)
                if row is not None:
                    dest[i], keep[slot, i] = row, True
            self.prefix.touch(shared + [int(r) for r in dest if r >= 0])
            if (dest >= 0).any():
                self.blocks = export_blocks(self.tables, self.blocks, jnp.int32(slot),
                                            jnp.asarray(dest))
        mask = np.zeros(self.max_num_seqs + 1, bool)
        mask[slot] = True
        self.free, self.tables = release(self.free, self.tables, jnp.asarray(mask),
                                         jnp.asarray(keep))
        held = -(-len(tokens) // self.page_size)
        self.free_pages += (held - int(keep[slot].sum())) * self.block_pages
        self.slot_tokens[slot], self._slot_rows[slot] = [], []
        self._free_slots.append(slot)

    # ------------------------------------------------------------------ steps

    def step(self, prefill: Sequence[Row], decode: Sequence[Row]
             ) -> tuple[list[Sampled], list[Sampled]]:
        """Feed every row its tokens; returns what was sampled after each row's last token
        (prefill rows, decode rows). A prefill row takes up to `prefill_chunk` tokens, a
        decode row exactly one."""
        rows = list(prefill) + list(decode)
        if not rows:
            return [], []
        slots = [r.slot for r in rows]
        if len(set(slots)) != len(slots):
            raise ValueError("a slot appears twice in one step")
        for r in prefill:
            if not 1 <= len(r.tokens) <= self.prefill_chunk:
                raise ValueError(f"a prefill row feeds 1..{self.prefill_chunk} tokens, "
                                 f"got {len(r.tokens)}")
        for r in decode:
            if len(r.tokens) != 1:
                raise ValueError("a decode row feeds exactly one token")
        new_len = np.zeros(self.max_num_seqs + 1, np.int32)
        need = 0
        for r in rows:
            if r.slot in self._free_slots or not 0 <= r.slot < self.max_num_seqs:
                raise ValueError(f"slot {r.slot} holds no open sequence")
            new_len[r.slot] = len(self.slot_tokens[r.slot]) + len(r.tokens)
            if new_len[r.slot] > self.max_model_len:
                raise ValueError(f"slot {r.slot} would hold {new_len[r.slot]} tokens; "
                                 f"max_model_len is {self.max_model_len}")
            need += self.pages_to_grow(r.slot, len(r.tokens))
        if not self._make_room(need):
            raise RuntimeError(f"the step needs {need} new KV pages and only "
                               f"{self.available_pages} can be had")
        t0 = time.perf_counter()
        self.write_restores([s for s in list(self._restores) if s not in slots])
        self.free, self.tables, ok = reserve(self.free, self.tables, jnp.asarray(new_len))
        self.free_pages -= need
        groups = [[prefill[i] for i in g]
                  for g in self.runner.prefill_groups([len(r.tokens) for r in prefill])]
        groups += [list(decode)] if decode else []
        outs = [self._call(g) for g in groups]
        ok, outs = jax.device_get((ok, outs))
        if not ok:
            raise RuntimeError("page reservation failed although the host count allowed it")
        self._written(slots)  # layer-wise restores of these slots are in the pool now
        for r in rows:
            self.slot_tokens[r.slot].extend(int(t) for t in r.tokens)
        seconds = time.perf_counter() - t0
        self.stats.steps += 1
        fed = sum(len(r.tokens) for r in prefill)
        self.stats.prefill_tokens += fed
        self.stats.decode_tokens += len(decode)
        if prefill:
            self.stats.prefill_seconds += seconds
        else:
            self.stats.decode_seconds += seconds
        sampled: dict[int, Sampled] = {}
        for group, (tokens, logprob, top_ids, top_lp) in zip(groups, outs, strict=True):
            for i, r in enumerate(group):
                sampled[id(r)] = Sampled(int(tokens[i]), float(logprob[i]), top_ids[i],
                                         top_lp[i])
        return [sampled[id(r)] for r in prefill], [sampled[id(r)] for r in decode]

    # ------------------------------------------------------------------ shapes

    def shapes(self) -> list[tuple[int, int]]:
        """Every (rows, tokens) a step's calls can have (`ModelRunner.shapes`)."""
        return self.runner.shapes()

    def warmup(self, progress=None) -> int:
        """Compile every step shape now, so serving never waits on a compilation (padding
        rows only: what they write is never read). `progress(done, total)` after each shape.
        Returns how many of the shapes were not compiled yet."""
        todo, new = self.shapes(), 0
        for i, (b, t) in enumerate(todo):
            before = self.num_compiles
            jax.block_until_ready(self._call([], padded_rows=b, padded_tokens=t))
            new += self.num_compiles > before
            if progress is not None:
                progress(i + 1, len(todo))
        self.warmup_transfers()
        return new

    def warmup_transfers(self) -> None:
        """Compile the page copies a KV store uses (saving a slot's blocks, restoring them
        at once or layer by layer) for every block count bucket, on null pages only."""
        count = 1
        while True:
            ids = slot_page_ids(self.tables.pages, jnp.int32(self.scratch), jnp.int32(0),
                                jnp.int32(0), count=count)  # all null: nothing is written
            pages = gather_pages(self.pool, ids)
            self.pool = scatter_pages(self.pool, np.zeros(ids.shape, np.int32),
                                      jax.device_get(pages))
            if self.execution == "layerwise":
                self.pool = scatter_pages(self.pool, np.zeros(ids.shape[::2], np.int32),
                                          jax.device_put({f: np.asarray(x)[:, 0]
                                                          for f, x in pages.items()}))
            if count >= self.max_pages:
                break
            count *= 2
        jax.block_until_ready(self.pool)

    def _call(self, rows: Sequence[Row], *, padded_rows: int | None = None,
              padded_tokens: int | None = None) -> tuple:
        """Dispatch one compiled call for `rows`, padded with scratch rows to the bucket
        (or to the shape given, as `warmup` does with no rows at all)."""
        batch = self.runner.batch(rows, [len(self.slot_tokens[r.slot]) for r in rows],
                                  padded_rows=padded_rows, padded_tokens=padded_tokens)
        self.stats.step_shapes.add(batch.shape)
        restores = [self._restores[r.slot] for r in rows if r.slot in self._restores]
        before_layer = self._stage_restores(restores, batch.valid.sum()) if restores else None
        out, self.pool, self.filling = self.runner.run(self.pool, self.filling,
                                                       self.tables.pages, batch, before_layer)
        return out

    def _stage_restores(self, restores: list[_Restore], new_tokens: int):
        """A `before_layer` that writes restored layers into the pool: each layer's pages
        are copied to the device a few layers ahead (the read buffer) while earlier layers
        compute, and scattered just before their layer."""
        layers = self.cfg.num_layers
        ahead = self.read_buffer_layers(sum(r.nbytes for r in restores), int(new_tokens))
        staged: dict[int, list] = {}

        def stage(index: int) -> None:
            staged[index] = [(r.ids[:, index], jax.device_put(
                {f: x[:, index] for f, x in r.pages.items()})) for r in restores]

        for index in range(min(ahead, layers)):
            stage(index)

        def before_layer(index: int, pool):
            if index + ahead < layers:
                stage(index + ahead)
            for ids, pages in staged.pop(index, ()):
                pool = scatter_pages(pool, ids, pages)
            return pool

        return before_layer
