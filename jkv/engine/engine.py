"""One step of work on the device: sequences in slots, their pages, the prefix cache.

The engine composes five parts and checks that what it is asked to do fits: the KV cache
manager (`jkv.kv.manager`: pool, tables, slots, budget, the layout), its layout's connector
(`connector`, `row_connector`: KV to the store and back) and layer offload (LayerKV:
`jkv.kv.layer_offload`, `jkv.kv.row_moves`; `layer_major` prefill), and the model runner
(`runner`, the only caller of the model). A step feeds some slots a chunk of prompt and others
one decoded token; `execution` says how restored KV reaches the pool ("scan": before the step,
"layerwise": layer by layer while earlier layers compute). The scheduler picks what runs.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jkv.attention.backend import resolve_backend
from jkv.config import CacheConfig, EngineConfig, ModelConfig
from jkv.engine.connector import KVConnector
from jkv.engine.layer_major import LayerMajor
from jkv.engine.records import EngineStats, Sampled, check_row_sizes, sampled_rows
from jkv.engine.row_connector import RowConnector
from jkv.engine.runner import ModelRunner, Row, unchanged_layer
from jkv.engine.sampling import counter_key, seed_key
from jkv.engine.saved_pages import SavedPages, split_chunk
from jkv.engine.split_recompute import recompute_split
from jkv.kv.layer_offload import LayerOffload, resident_layers
from jkv.kv.manager import KVCacheManager
from jkv.kv.row_layer_offload import RowLayerOffload
from jkv.models.family import ModelFamily, split_params
from jkv.models.llama import LLAMA, Params
from jkv.policies import POLICIES

# the connector of each layout (`Layout.name`)
CONNECTORS = {"blocks": KVConnector, "rows": RowConnector}
LAYER_OFFLOADS = {"blocks": LayerOffload, "rows": RowLayerOffload}

__all__ = ["Engine", "EngineStats", "Row", "Sampled", "SavedPages"]


class Engine:
    """Runs steps over sequence slots; see `open`, `step` and `close`."""

    def __init__(self, cfg: ModelConfig, params: Params, *, cache: CacheConfig,
                 config: EngineConfig, model_id: str = "",
                 shape_step: int | None = None, family: ModelFamily = LLAMA) -> None:
        """`config` is validated where it is made; its max_model_len None means the model's
        limit (`EngineConfig.resolve_max_model_len`)."""
        params, mesh = split_params(family, params, cfg, config.tensor_parallel)
        self.config, self.cfg, self.params = config, cfg, params
        self.max_model_len = config.resolve_max_model_len(cfg.max_position_embeddings)
        self.max_num_seqs, self.prefill_chunk = config.max_num_seqs, config.prefill_chunk
        self.page_size = cache.page_size
        self.attention_backend = resolve_backend(config.attention_backend)
        self.execution = config.execution
        dtype = params["embed"].dtype
        hash_seed = (f"{model_id}|{cache.kv_format.name}|{cache.page_size}|"
                     f"{jnp.dtype(dtype).name}|{cfg}"
                     # k8v4t etc. were unrotated before: their stored entries must not match
                     f"{'|rotated' if cache.kv_format.rotated else ''}").encode()
        self.kv_format = cache.kv_format.name
        self.kv_dtype = dtype  # (a 16-bit side's, unless the format says bfloat16)
        self.kv_bf16_ratio = 2 / cache.kv_format.float_dtype(dtype).itemsize  # over a pool's
        self.cache = KVCacheManager(
            num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            dtype=dtype, kv_format=cache.kv_format, page_size=cache.page_size,
            kv_cache_bytes=cache.kv_cache_bytes, max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs, enable_prefix_caching=config.enable_prefix_caching,
            device_cache_bytes=config.device_cache_bytes, hash_seed=hash_seed,
            tiers=POLICIES[cache.kv_policy].tier_policy(cache), mesh=mesh)
        layout = self.cache.layout
        # names the KV this engine writes (model, format, page size, shapes, layout) in
        # stored entries
        self.fingerprint = hashlib.blake2b(self.cache.hash_seed, digest_size=16).hexdigest()
        # LayerKV's layer-wise offload, as the layout holds a layer on the host
        self.layers = LAYER_OFFLOADS[layout.name](self.cache)
        self.connector = CONNECTORS[layout.name](
            self.cache, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
            rotate=family.rotate_keys(cfg), layerwise=self.execution == "layerwise")
        self.runner = ModelRunner(cfg, params, family, backend=self.attention_backend,
                                  layer_by_layer=self.execution == "layerwise",
                                  max_rows=self.max_num_seqs, scratch_slot=self.cache.scratch,
                                  prefill_chunk=self.prefill_chunk, page_size=self.page_size,
                                  # only significance reads it: others share compilations
                                  max_tokens=self.max_model_len if layout.filling_scores
                                  else None, shape_step=shape_step, mesh=mesh)
        # how much of a split restore's shorter part (recompute or load) hides behind the
        # longer (`restore_planning.split_share`; 0: never split). 0 on every backend:
        # benchmarks/restore.py's split rows were slower than the whole load on a CPU (both
        # parts take the same cores) and on an H200 too (docs/results.md, CachedAttention;
        # timed before the recomputed part went layer-major: benchmarks/gpu_session.sh 1)
        self.split_overlap = 0.0
        # a CPU backend takes 64-byte aligned host arrays as they are (a restore's pages:
        # no copy in the step), so a store for this engine hands them over aligned
        self.aligned_host_arrays = jax.default_backend() == "cpu"
        # prompts with layers on the host fed a layer at a time over all their tokens
        self.layer_major = LayerMajor(self.cache, self.runner, self.layers, cfg.num_layers,
                                      self.prefill_chunk)
        self._seed, self._requests_seen = config.seed, 0
        self.stats = EngineStats()

    @property
    def num_compiles(self) -> int:
        """Compiled variants of the step functions (a steady workload must not add any)."""
        return self.runner.num_compiles + self.cache.layout.num_compiles

    def request_key(self, seed: int | None) -> np.ndarray:
        """A request's PRNG key: from its seed, or the engine's seed and a request counter."""
        if seed is None:
            self._requests_seen += 1
            return counter_key(self._seed, self._requests_seen - 1)
        return seed_key(seed)

    # ------------------------------------------------------------------ sequences

    def open(self, token_ids: Sequence[int], restore: SavedPages | None = None,
             use_prefix_cache: bool = True, max_cached: int | None = None,
             recompute: float = 0.0, resident: int | None = None,
             prompt_tokens: int | None = None) -> tuple[int, int]:
        """Take a free slot for a sequence whose prompt is `token_ids`.

        Returns (slot, cached): the first `cached` tokens are already held (prefix cache
        hits unless `use_prefix_cache` is False, at most `max_cached` of them, then the blocks
        of `restore` past them: saved pages of this prompt's first blocks, written into new
        pages, or a saved whole row: the connector's); feed the rest with `step`.
        `recompute` in [0, 1]: about that share of the restored blocks' KV is recomputed
        while the rest loads (Krul's split restore, `KVConnector.pyramid`; not for a whole
        row, which is restored whole). `resident`: only that many layers keep pages in the
        pool, spread over the depth (`resident_layers`); the others are held on the host
        from the start and their prefill goes through the pool a layer at a time
        (LayerKV; `fetch_layers` brings them back). `prompt_tokens`: where its own prompt
        ended (a preempted request resuming; default all): decided there, not again.
        """
        if not 0.0 <= recompute <= 1.0:
            raise ValueError(f"recompute must be in [0, 1], got {recompute}")
        if resident is not None:
            keep = resident_layers(self.cfg.num_layers, resident)  # ValueError if out of range
        if not 1 <= len(token_ids) < self.max_model_len:
            raise ValueError(f"a prompt needs 1..{self.max_model_len - 1} tokens, "
                             f"got {len(token_ids)}")
        if restore is not None:  # raises before anything is taken
            restorable = self.connector.restorable(restore, token_ids)
        slot, cached = self.cache.open(token_ids, use_prefix_cache, max_cached, prompt_tokens)
        if self.cache.enable_prefix_caching:
            self.stats.prefix_query_tokens += len(token_ids)
        self.stats.prefix_hit_tokens += cached
        if restore is not None:
            held = self._restore(slot, cached // self.page_size, restorable, restore,
                                 token_ids, recompute)
            self.stats.restored_tokens += held - cached
            self.cache.add_tokens(slot, token_ids[cached:held])
            cached = held
        if resident is not None and not keep.all():
            self.offload_layers(slot, np.flatnonzero(~keep).tolist())
        return slot, cached

    def offload_layers(self, slot: int, layers: Sequence[int]) -> int:
        """Move `layers` of the open sequence in `slot` to host memory (its steps bring each
        in for its turn, `fetch_layers` for good); returns the pages freed."""
        if not self.cache.is_open(slot):
            raise ValueError(f"slot {slot} holds no open sequence")
        self._not_mid_prompt(slot)
        self.connector.write([slot])  # a queued restore goes into its pages first
        return self.layers.offload(slot, layers)

    def _not_mid_prompt(self, slot: int) -> None:
        """ValueError while `slot`'s prompt is part way through its layers (layer-major)."""
        if self.layer_major.next_layer(slot):
            raise ValueError(f"slot {slot} is part way through a layer-major prefill")

    def keep_resident(self, slot: int, keep: int) -> int:
        """Offload layers of `slot` until `keep`, spread over the depth, stay; how many moved."""
        layers = [x for x in range(self.cfg.num_layers) if x not in self.offloaded_layers(slot)]
        kept = resident_layers(len(layers), min(keep, len(layers)))
        out = [x for x, k in zip(layers, kept, strict=True) if not k]
        self.offload_layers(slot, out)
        return len(out)

    def offloaded_layers(self, slot: int) -> list[int]:
        """The layers of `slot` held in host memory."""
        return self.layers.layers(slot)

    def pages_to_fetch(self, slot: int) -> int:
        """Pages `fetch_layers(slot)` takes."""
        return self.layers.pages_to_fetch(slot)

    def fetch_layers(self, slot: int) -> None:
        """Bring every offloaded layer of `slot` back (RuntimeError without the pages)."""
        self._not_mid_prompt(slot)
        self.layers.fetch(slot)

    def _restore(self, slot: int, first: int, n: object, saved: SavedPages,
                 token_ids: Sequence[int], recompute: float) -> int:
        """Saved KV into `slot`, which holds `first` blocks (`n`: what the connector's
        `restorable` said of it); with `recompute`, or the front an entry did not keep, the
        pyramid's recomputed blocks are dispatched before the loads' copies (on a GPU they
        overlap). Returns the tokens the slot then holds."""
        ps = self.page_size
        loaded_from = self.connector.split(first, n, recompute,
                                           split_chunk(self.prefill_chunk, ps), saved.front)
        held = self.connector.restore(slot, first, saved, token_ids, loaded_from)
        if held > first * ps:
            if loaded_from is not None:
                shapes, tokens = recompute_split(self.runner, self.cache, slot, token_ids,
                                                 first, loaded_from, self.prefill_chunk)
                self.stats.step_shapes |= shapes
                self.stats.recomputed_tokens += tokens
            self.connector.write_due(slot)
        return held

    def close(self, slot: int, finished: bool = True, keep: bool = True) -> None:
        """End the sequence in `slot`: what its layout keeps (full blocks in the prefix
        cache, a whole row) is kept when prefix caching is on, its other pages go back to
        the pool. `finished` False: preempted (what it held does not count in the
        statistics of finished sequences). `keep` False: nothing of it is kept (its KV is
        suspect), nor is what the connector says may not be (`KVConnector.keepable`: a row
        restored from a smaller stored form)."""
        keep = keep and self.connector.keepable(slot)
        if keep:
            self.layers.before_close(slot)
        shareable = self.connector.shareable_blocks(slot) if keep else 0
        self.connector.forget(slot)  # a restore never written: the request ended first
        ahead = self.layer_major.drop(slot)
        self.cache.close(slot, shareable, finished, keep, ahead)

    def gather(self, slot: int, start: int = 0, approximate: bool = False) -> SavedPages:
        """The full blocks `slot` holds from block `start` on, being copied out of the pool
        (`KVConnector.gather`: `approximate`, with its approximate blocks too; a whole row
        where the layout keeps rows: `RowConnector.gather`)."""
        return self.connector.gather(slot, start, approximate)

    def saved_hashes(self, slot: int, approximate: bool = False) -> list[bytes]:
        """Block hashes of what `gather(slot, approximate=...)` saves (a whole row: none)."""
        return self.connector.saved_hashes(slot, approximate)

    def save_pages(self, slot: int) -> SavedPages:
        """The full blocks `slot` holds (a whole row: its tiers' pages), copied to the host."""
        return self.gather(slot).fetch()

    def rebase(self, saved: SavedPages, token_ids: Sequence[int], keep: int,
               drop: int) -> SavedPages:
        """Saved pages moved for a truncated prompt (`KVConnector.rebase`)."""
        return self.connector.rebase(saved, token_ids, keep, drop)

    def convert_stored(self, arrays: dict, src: str, dst: str) -> dict[str, np.ndarray]:
        """A stored entry's pages in KV format `src` as pages of `dst` (a smaller form made
        for AdaptCache, or one read back into the pool's: `kv_forms.convert_pages`,
        approximate KV); ValueError for a format this jkv does not know or pages not of
        it. A stored whole row's forms are the pool's format and row forms, which drop
        tokens (`RowConnector.convert_stored`)."""
        return self.connector.convert_stored(arrays, src, dst, self.kv_dtype)

    def read_buffer_layers(self, load_bytes: int, new_tokens: int) -> int:
        """Layers of restored KV a layer-wise step keeps in flight, from measured rates
        (`KVConnector.read_buffer_layers`)."""
        return self.connector.read_buffer_layers(load_bytes, new_tokens,
                                                 self.stats.prefill_token_seconds)

    # ------------------------------------------------------------------ steps

    def _check_rows(self, prefill: Sequence[Row], decode: Sequence[Row]) -> dict[int, int]:
        """ValueError unless the rows are a valid step; returns each slot's new length."""
        check_row_sizes(prefill, decode, self.prefill_chunk)
        for r in prefill:
            if r.layer_span is not None:
                if not self.layers.layer_major:
                    raise ValueError("a layer-major prefill needs block pages (a token-tier "
                                     "policy places a prompt after each chunk)")
                self.layer_major.check(r)
        lengths: dict[int, int] = {}
        for r in list(prefill) + list(decode):
            if r.slot in lengths:
                raise ValueError("a slot appears twice in one step")
            if not self.cache.is_open(r.slot):
                raise ValueError(f"slot {r.slot} holds no open sequence")
            lengths[r.slot] = len(self.cache.slot_tokens[r.slot]) + len(r.tokens)
            if lengths[r.slot] > self.max_model_len:
                raise ValueError(f"slot {r.slot} would hold {lengths[r.slot]} tokens; "
                                 f"max_model_len is {self.max_model_len}")
        return lengths

    def step(self, prefill: Sequence[Row], decode: Sequence[Row]
             ) -> tuple[list[Sampled | None], list[Sampled]]:
        """Feed every row its tokens; returns what was sampled after each row's last token
        (prefill rows, decode rows). A prefill row takes up to `prefill_chunk` tokens, a
        decode row exactly one; a layer-major prefill row (`Row.layer_span`) its whole prompt
        through those layers (None sampled before its last layer)."""
        rows = list(prefill) + list(decode)
        if not rows:
            return [], []
        lengths = self._check_rows(prefill, decode)
        t0 = time.perf_counter()
        self.connector.write_all_but(list(lengths))
        layered = [r for r in prefill if r.layer_span is not None]
        chunked = [r for r in prefill if r.layer_span is None]
        held = {r.slot: len(self.cache.slot_tokens[r.slot]) for r in layered}
        # a layer-major prompt's resident pages are all taken by its first step
        ok = self.cache.grow({s: n for s, n in lengths.items()
                              if s not in held or self.layer_major.next_layer(s) == 0},
                             self.layers.step_pages(lengths))
        groups = [[chunked[i] for i in g]
                  for g in self.runner.prefill_groups([len(r.tokens) for r in chunked])]
        groups += [list(decode)] if decode else []
        plans: list = []  # placements after every call: a layer brought in never waits on one
        outs = [self._call(g, plans=plans) for g in groups]
        for plan in plans:
            self.cache.layout.after_call(plan)
        outs_layered = [self.layer_major.run(r, held[r.slot]) for r in layered]
        ok, outs, outs_layered = jax.device_get((ok, outs, outs_layered))
        if not ok:
            raise RuntimeError("page reservation failed although the host count allowed it")
        self.layers.settle()
        self.cache.layout.after_step()
        self.connector.written(list(lengths))  # layer-wise restores are in the pool now
        done = [r for r, out in zip(layered, outs_layered, strict=True) if out is not None]
        for r in chunked + list(decode) + done:
            self.cache.add_tokens(r.slot, r.tokens)
        seconds = time.perf_counter() - t0
        self.stats.steps += 1
        self.stats.prefill_tokens += sum(len(r.tokens) for r in chunked + done)
        self.stats.decode_tokens += len(decode)
        if prefill:
            self.stats.prefill_seconds += seconds
        else:
            self.stats.decode_seconds += seconds
        sampled = sampled_rows(groups, outs, layered, outs_layered)
        return [sampled[id(r)] for r in prefill], [sampled[id(r)] for r in decode]

    def _call(self, rows: Sequence[Row], *, padded_rows: int | None = None,
              padded_tokens: int | None = None, layered: bool = False,
              plans: list | None = None) -> tuple:
        """Dispatch one compiled call for `rows`, padded to the bucket (or to the shape given,
        as `warmup` does with no rows); then the layout's placement, or its plan added to
        `plans` for the caller to run after the step's calls."""
        c = self.cache
        batch = self.runner.batch(rows, [len(c.slot_tokens[r.slot]) for r in rows],
                                  padded_rows=padded_rows, padded_tokens=padded_tokens)
        self.stats.step_shapes.add(batch.shape)
        slots, (b, t), after_layer = [r.slot for r in rows], batch.shape, None
        before_layer = self.connector.stage(slots, int(batch.valid.sum()),
                                            self.stats.prefill_token_seconds)
        plan = c.layout.placement(slots, [len(r.tokens) for r in rows], b, t, t == 1)
        if any(r.slot in c.offloaded for r in rows):
            lengths = {r.slot: len(c.slot_tokens[r.slot]) + len(r.tokens) for r in rows
                       if r.slot in c.offloaded}
            before_layer, after_layer = self.layers.step_hooks(lengths, before_layer, plan)
        elif layered:  # layer by layer, as a step with offloaded layers runs (`warmup`)
            after_layer = unchanged_layer
        out = c.run_model(lambda pool, filling, pages, tiers: self.runner.run(
            pool, filling, pages, batch, before_layer, tiers, after_layer))
        c.layout.after_call(plan) if plans is None else plans.append(plan)
        return out

    def shapes(self) -> list[tuple[int, int]]:
        """Every (rows, tokens) a step's calls can have (`ModelRunner.shapes`)."""
        return self.runner.shapes()

    def warmup(self, progress=lambda done, total: None) -> int:
        """Compile every step shape now (`warm_call`), so serving never waits on one, then
        `warm_own`. `progress(done, total)` after each shape. Returns how many were new."""
        todo, new = self.shapes(), 0
        for i, (rows, tokens) in enumerate(todo):
            before = self.num_compiles
            self.warm_call(rows, tokens)
            new += self.num_compiles > before
            progress(i + 1, len(todo))
        self.warm_own()
        return new

    def warm_call(self, rows: int, tokens: int) -> None:
        """Compile step shape rows x tokens: a call of padding rows (what they write is never
        read), and where steps scan, one layer by layer (as with offloaded layers)."""
        for layered in (False, True)[: 1 + (not self.runner.layer_by_layer)]:
            jax.block_until_ready(self._call([], padded_rows=rows, padded_tokens=tokens,
                                             layered=layered))

    def warm_own(self) -> None:
        """Compile what opens, grows, ends and saves a sequence beside its steps: a request's
        key without a seed, the layout's, layer offload's and connector's own calls."""
        counter_key(self._seed, 0)
        for part in (self.cache, self.layers, self.layer_major, self.connector):
            part.warmup()
