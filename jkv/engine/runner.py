"""The model runner: a step's compiled calls into a model family, and their shapes.

The only module that calls a model family (`jkv.models.family.ModelFamily`). A call runs
padded rows of tokens through the model over the page pool and samples one token per row.
Its shapes come from a small closed set (`shapes`): rows and prompt tokens padded to powers
of `shape_step` (4 on a GPU, 2 on CPU, where decode rows are finer: `decode_bucket`), prefill
rows grouped so that rows x tokens stays under an area cap; the page-table width is always
the whole table (both attention backends stop at each row's held pages). `warmup` compiles
the whole set, so serving never stalls on a compilation.

Two ways through the layers, with the same outputs: one compiled call that scans every
layer (`_step`), or one dispatch of the same compiled layer per layer (`_layer_step`), which
lets the caller write restored KV into the pool just before the layer that reads it
(`run(before_layer=)`) and move a layer's pages out after it (`after_layer`: layer
offload). On CPU the layer-by-layer way always runs, over each layer's own weight arrays
(`_layer_views`): XLA there copies a layer's weights out of the stacked arrays whenever the
layer is picked by a traced index, which costs as much as a decode step's matmuls (and a
noticeable share of a prefill chunk).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jkv.attention.layer_kv import LayerKV, LayerTiers
from jkv.config import ModelConfig
from jkv.engine.fingerprints import marks, sketch_matrix
from jkv.engine.sampling import SamplingParams, position_logprobs, sample, token_logprobs
from jkv.kv.buckets import bucket, decode_bucket
from jkv.kv.page_pool import FillingPages
from jkv.kv.pages import KVPages
from jkv.kv.token_tiers import TierCounts, TokenMeta
from jkv.models.family import ModelFamily

Params = dict


# a hook around one layer of a call: (index, pool, table pages, tiers) -> the same three
# after it (tiers: the layout's `model_tiers` as the call holds them, None without tiers)
LayerHook = Callable[[int, KVPages, jax.Array, tuple | None],
                     tuple[KVPages, jax.Array, tuple | None]]


def unchanged_layer(index: int, pool: KVPages, table_pages: jax.Array,
                    tiers: tuple | None) -> tuple[KVPages, jax.Array, tuple | None]:
    """A `LayerHook` that changes nothing (a call made to go layer by layer)."""
    return pool, table_pages, tiers


class Batch(NamedTuple):
    """One call's padded inputs (host arrays): `rows` x `tokens`."""

    slots: np.ndarray  # int32 [B]; padding rows: the scratch slot
    tokens: np.ndarray  # int32 [B, T]
    positions: np.ndarray  # int32 [B, T]
    valid: np.ndarray  # bool [B, T]
    last_idx: np.ndarray  # int32 [B]: each row's last real token
    keys: np.ndarray  # uint32 [B, 2]
    num_generated: np.ndarray  # uint32 [B]
    temperature: np.ndarray  # float32 [B]
    top_p: np.ndarray  # float32 [B]
    top_k: np.ndarray  # int32 [B]
    want_top: np.ndarray  # bool [B]: rows that asked for logprobs (their top alternatives)
    targets: np.ndarray | None = None  # int32 [B, T]: whose logprob each position gives (-1)

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape

    @property
    def sampling(self) -> tuple[np.ndarray, ...]:
        return (self.last_idx, self.keys, self.num_generated, self.temperature, self.top_p,
                self.top_k, self.want_top)


@dataclass
class Row:
    """One sequence's work in a step: feed `tokens` to `slot`, then sample one token."""

    slot: int
    tokens: Sequence[int]
    sampling: SamplingParams
    key: np.ndarray  # uint32[2]: the request's PRNG key (`Engine.request_key`)
    num_generated: int = 0  # folded into the key: token i of a request has its own stream
    # per fed token, the token whose logprob its position should give (-1: none), or None
    targets: Sequence[int] | None = None
    # a prefill fed layer-major (`jkv.engine.layer_major`): this step runs layers [first, last) over
    # all of `tokens`, and samples after the model's last layer only
    layer_span: tuple[int, int] | None = None


def _sample(family, params, h_last, keys, num_generated, temperature, top_p, top_k, want_top):
    logits = family.logits(params, h_last)
    keys = jax.vmap(jax.random.fold_in)(keys, num_generated)  # one stream per request
    tokens = sample(logits, keys, temperature, top_p, top_k)
    return (tokens, *token_logprobs(logits, tokens, want_top=want_top))


def _rows(pool, filling, meta, table_pages, slot_tiers, slots, max_tokens: int | None,
          mesh: Mesh | None, index=None) -> LayerKV:
    """The KV of the step's rows: every layer's (`LayerKV` with a layer axis after the
    batch axis), or layer `index`'s only (gathered alone: not every layer's filling pages
    for one layer's step), token tiers when `meta` is given (`slot_tiers`: every slot's tier
    counts and first query adding significance; no tier holding over `max_tokens`)."""
    at, tiers = (slots if index is None else (slots, index)), None
    if meta is not None:
        counts, observe = slot_tiers
        tiers = LayerTiers(meta=meta, score=filling.score[at], high=counts.high[at],
                           low=counts.low[at], max_tokens=max_tokens,
                           observe_from=None if observe is None else observe[slots])
    return LayerKV(pool=pool, fill_k=filling.k[at], fill_v=filling.v[at],
                   pages=table_pages[at], tiers=tiers, mesh=mesh)


def _put_rows(filling: FillingPages, slots, kv: LayerKV, index=None):
    """(pool, filling, meta) after the step: the rows' filling pages written back (at layer
    `index` only, when given). Padding rows all point at the scratch slot; what they write
    there is never read."""
    at = slots if index is None else (slots, index)
    score = None if kv.tiers is None else filling.score.at[at].set(kv.tiers.score)
    filling = FillingPages(k=filling.k.at[at].set(kv.fill_k), v=filling.v.at[at].set(kv.fill_v),
                           score=score)
    return kv.pool, filling, None if kv.tiers is None else kv.tiers.meta


def _step(params, pool, filling, meta, table_pages, slot_tiers, slots, tokens, positions, valid,
          last_idx, keys, num_generated, temperature, top_p, top_k, want_top, sketch, *,
          family: ModelFamily, cfg: ModelConfig, backend: str, max_tokens: int | None,
          page_size: int, mesh: Mesh | None):
    kv = _rows(pool, filling, meta, table_pages, slot_tiers, slots, max_tokens, mesh)
    hidden, kv = family.forward(params, cfg, tokens, positions, valid, kv, backend)
    h_last = jnp.take_along_axis(hidden, last_idx[:, None, None], axis=1)[:, 0]
    out = _sample(family, params, h_last, keys, num_generated, temperature, top_p, top_k,
                  want_top)
    return ((*out, *marks(hidden, positions, valid, sketch, page_size)),
            *_put_rows(filling, slots, kv))


def _embed(params, tokens, positions, *, family: ModelFamily, cfg: ModelConfig):
    return family.embed(params, tokens), family.positional(cfg, positions)


def _layer_step(weights, pool, filling, meta, table_pages, slot_tiers, slots, x, positional,
                positions, valid, index, *, family: ModelFamily, cfg: ModelConfig,
                backend: str, max_tokens: int | None, mesh: Mesh | None):
    """Layer `index`; `weights` are its own, or the params (the layer taken at `index`)."""
    if "layers" in weights:
        weights = family.layer_weights(weights, index)
    kv = _rows(pool, filling, meta, table_pages, slot_tiers, slots, max_tokens, mesh, index)
    x, kv = family.layer(weights, cfg, x, kv, positions, valid, positional, backend)
    return (x, *_put_rows(filling, slots, kv, index))


def _head(params, x, positions, valid, sketch, last_idx, keys, num_generated, temperature, top_p,
          top_k, want_top, *, family: ModelFamily, cfg: ModelConfig, page_size: int):
    hidden = family.final_norm(params, cfg, x)
    h_last = jnp.take_along_axis(hidden, last_idx[:, None, None], axis=1)
    return (*_sample(family, params, h_last[:, 0], keys, num_generated, temperature, top_p,
                     top_k, want_top), *marks(hidden, positions, valid, sketch, page_size))


def _layer_views(layers: Params, num_layers: int) -> list[Params] | None:
    """Each layer's weights as arrays over the stacked arrays' memory, where that costs no copy
    (CPU: a numpy view put on the device is used in place); None elsewhere."""
    if jax.default_backend() != "cpu":
        return None
    host = {name: np.asarray(w) for name, w in layers.items()}
    views = [{name: jax.device_put(w[i]) for name, w in host.items()} for i in range(num_layers)]
    in_place = all(host[name].ctypes.data == w.unsafe_buffer_pointer()
                   and views[i][name].unsafe_buffer_pointer() == host[name][i].ctypes.data
                   for name, w in layers.items() for i in range(num_layers))
    return views if in_place else None


@functools.lru_cache(maxsize=4)
def _compiled(family: ModelFamily, cfg: ModelConfig, backend: str,
              max_tokens: int | None, page_size: int, mesh: Mesh | None) -> tuple:
    """The jitted step, embed, layer and head functions of one model, backend, page size,
    (with token tiers) longest sequence and mesh, shared by every runner in the process: a
    second engine over the same model reuses what the first compiled. A few models at most,
    so compilations of models no longer served are freed."""
    static = dict(family=family, cfg=cfg)
    kv = dict(backend=backend, max_tokens=max_tokens, mesh=mesh)
    return (jax.jit(partial(_step, **static, **kv, page_size=page_size),
                    donate_argnums=(1, 2, 3)),
            jax.jit(partial(_embed, **static)),
            jax.jit(partial(_layer_step, **static, **kv), donate_argnums=(1, 2, 3)),
            jax.jit(partial(_head, **static, page_size=page_size)),
            jax.jit(partial(position_logprobs, **static)),
            jax.jit(family.layer_weights))  # a layer's weights, once for several calls


class ModelRunner:
    """Compiled calls of one model over one page pool layout; see `batch` and `run`."""

    def __init__(self, cfg: ModelConfig, params: Params, family: ModelFamily, *,
                 backend: str, layer_by_layer: bool, max_rows: int, scratch_slot: int,
                 prefill_chunk: int, max_tokens: int | None, page_size: int,
                 shape_step: int | None = None, mesh: Mesh | None = None) -> None:
        self.cfg, self.params, self.family = cfg, params, family
        self.max_rows, self.scratch_slot, self.prefill_chunk = max_rows, scratch_slot, prefill_chunk
        # shapes grow by this factor: 4 on a GPU (few shapes, all compiled up front; padding
        # is cheap there), 2 on CPU (padded work costs its full time there)
        if shape_step is None:
            shape_step = 4 if jax.default_backend() == "gpu" else 2
        if shape_step not in (2, 4):
            raise ValueError(f"shape_step must be 2 or 4, got {shape_step}")
        self.shape_step = shape_step
        # a prefill call's padded rows x tokens stays under this (rows are split otherwise)
        self.prefill_area = 4 * prefill_chunk
        # a call's own cost (its dispatches, embedding, head) in padded prefill tokens: rows
        # share a call only where that adds at most this much padding over separate calls
        # (about a call's cost on a CPU, chosen by measurement)
        self.call_tokens = 16 * shape_step
        # over a tensor-parallel mesh the params are split (`family.shard`): no views
        self.views = None if mesh else _layer_views(params["layers"], cfg.num_layers)
        self.device = NamedSharding(mesh, PartitionSpec()) if mesh else jax.devices()[0]
        # each layer's index on the device once (not copied there at every layer's call)
        self.indices = [jnp.asarray(np.int32(i)) for i in range(cfg.num_layers)]
        self.layer_by_layer = layer_by_layer or self.views is not None
        (self._step, self._embed, self._layer, self._head, self._positions,
         self._take) = _compiled(family, cfg, backend, max_tokens, page_size, mesh)
        self.sketch = jnp.asarray(sketch_matrix(cfg.hidden_size))  # (`fingerprints.marks`)

    @property
    def num_compiles(self) -> int:
        """Compiled variants of the step functions, shared with every runner of the same model
        and backend (a steady workload must not add any)."""
        return sum(f._cache_size() for f in (self._step, self._embed, self._layer, self._head,
                                             self._positions, self._take))

    # ------------------------------------------------------------------ shapes

    def rows_bucket(self, n: int) -> int:
        """Rows of a prefill call padded: powers of `shape_step`."""
        return min(bucket(n, 1, self.shape_step), self.max_rows)

    def decode_rows_bucket(self, n: int) -> int:
        """Rows of a decode call padded (`jkv.kv.buckets.decode_bucket`: finer on a CPU)."""
        return min(decode_bucket(n, self.shape_step), self.max_rows)

    def tokens_bucket(self, n: int) -> int:
        return 1 if n == 1 else min(self.prefill_chunk, bucket(n, 16, self.shape_step))

    def prefill_groups(self, lengths: Sequence[int]) -> list[list[int]]:
        """Indices of prefill rows (of these token counts) in calls, longest first. A row
        joins the last call where the padded rows x tokens stays within `prefill_area` and
        grows by at most `call_tokens` over the row's own call: a 2-token tail beside a
        508-token chunk gets its own 16-token call, not a second 512-token row of padding
        (which doubled a CPU step)."""
        groups: list[list[int]] = []
        for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            if groups:
                g = groups[-1]
                t = self.tokens_bucket(lengths[g[0]])
                joined = self.rows_bucket(len(g) + 1) * t
                apart = self.rows_bucket(len(g)) * t + self.tokens_bucket(lengths[i])
                if joined <= self.prefill_area and joined - apart <= self.call_tokens:
                    g.append(i)
                    continue
            groups.append([i])
        return groups

    def shapes(self) -> list[tuple[int, int]]:
        """Every (rows, tokens) a call can have: decode rows, then prefill calls."""
        step = self.shape_step
        row_buckets = sorted({self.rows_bucket(step ** i) for i in range(24)})
        token_buckets = sorted({self.tokens_bucket(16 * step ** i) for i in range(24)})
        out = [(b, 1) for b in sorted({self.decode_rows_bucket(n)
                                        for n in range(1, self.max_rows + 1)})]
        out += [(b, t) for t in token_buckets for b in row_buckets if b * t <= self.prefill_area]
        return out

    # ------------------------------------------------------------------ calls

    def batch(self, rows: Sequence[Row], held: Sequence[int], *,
              padded_rows: int | None = None, padded_tokens: int | None = None) -> Batch:
        """`rows` (after `held` tokens each) padded with scratch rows to their bucket (or to
        the shape given)."""
        t = padded_tokens or self.tokens_bucket(max(len(r.tokens) for r in rows))
        b = padded_rows or (self.decode_rows_bucket if t == 1 else self.rows_bucket)(len(rows))
        out = Batch(slots=np.full(b, self.scratch_slot, np.int32),
                    tokens=np.zeros((b, t), np.int32), positions=np.zeros((b, t), np.int32),
                    valid=np.zeros((b, t), bool), last_idx=np.zeros(b, np.int32),
                    keys=np.zeros((b, 2), np.uint32), num_generated=np.zeros(b, np.uint32),
                    temperature=np.zeros(b, np.float32), top_p=np.ones(b, np.float32),
                    top_k=np.zeros(b, np.int32), want_top=np.zeros(b, bool),
                    targets=np.full((b, t), -1, np.int32) if any(
                        r.targets is not None for r in rows) else None)
        for i, (r, n) in enumerate(zip(rows, held, strict=True)):
            m = len(r.tokens)
            out.slots[i] = r.slot
            out.tokens[i, :m] = r.tokens
            out.positions[i] = n + np.arange(t)
            out.valid[i, :m] = True
            out.last_idx[i] = m - 1
            out.keys[i] = r.key
            out.num_generated[i] = r.num_generated
            s = r.sampling
            out.temperature[i], out.top_p[i], out.top_k[i] = s.temperature, s.top_p, max(
                s.top_k, 0)
            out.want_top[i] = bool(s.logprobs)
            if r.targets is not None:
                out.targets[i, :m] = r.targets
        return out

    def run(self, pool: KVPages, filling: FillingPages, table_pages: jax.Array, batch: Batch,
            before_layer: LayerHook | None = None,
            tiers: tuple[TokenMeta, TierCounts, jax.Array | None] | None = None,
            after_layer: LayerHook | None = None
            ) -> tuple[tuple, KVPages, FillingPages, TokenMeta | None]:
        """One call: returns ((tokens, logprobs, top ids, top logprobs, fingerprint positions,
        fingerprints: `fingerprints.marks`), pool, filling, meta), dispatched, not awaited;
        with `batch.targets`, the first part also has each
        position's (target logprob, top ids, top logprobs). `before_layer` and `after_layer`
        (either makes the call go layer by layer) may write into the pool and change the
        page tables before and after layer `index` runs. `tiers`: the layout's `model_tiers`
        (token meta, tier counts with this step's pages, first queries adding significance)."""
        meta, slot_tiers = (None, None) if tiers is None else (tiers[0], tiers[1:])
        hooked = before_layer is not None or after_layer is not None
        if not self.layer_by_layer and batch.targets is None and not hooked:
            out, pool, filling, meta = self._step(
                self.params, pool, filling, meta, table_pages, slot_tiers, batch.slots,
                batch.tokens, batch.positions, batch.valid, *batch.sampling, self.sketch)
            return out, pool, filling, meta
        x, pool, filling, meta = self._layers(pool, filling, meta, table_pages, slot_tiers, batch,
                                              self.cfg.num_layers, before_layer, after_layer)
        out = self.head(x, batch)
        if batch.targets is not None:
            out = (*out, *self._positions(self.params, x, batch.targets))
        return out, pool, filling, meta

    def _layers(self, pool, filling, meta, table_pages, slot_tiers, batch: Batch, num_layers: int,
                before_layer: LayerHook | None, after_layer: LayerHook | None) -> tuple:
        x, inputs = self.embed(batch)
        tiers = None if meta is None else (meta, *slot_tiers)  # (hooks may change them)
        for index in range(num_layers):
            if before_layer is not None:
                pool, table_pages, tiers = before_layer(index, pool, table_pages, tiers)
            x, pool, filling, meta = self.layer(index, pool, filling, table_pages, x, inputs,
                                                *((None, None) if tiers is None else
                                                  (tiers[0], tiers[1:])))
            tiers = None if meta is None else (meta, *tiers[1:])
            if after_layer is not None:
                pool, table_pages, tiers = after_layer(index, pool, table_pages, tiers)
        return x, pool, filling, None if tiers is None else tiers[0]

    def embed(self, batch: Batch) -> tuple[jax.Array, tuple]:
        """A call's first part, going layer by layer: the embedded tokens and what every
        layer of it is given (`layer`'s `inputs`), on the device."""
        # committed to the device like every layer's outputs, so that layer 0's inputs are
        # placed as the others' and all layers share one compilation
        slots, tokens, positions, valid = jax.device_put(
            (batch.slots, batch.tokens, batch.positions, batch.valid), self.device)
        x, positional = self._embed(self.params, tokens, positions)
        return x, (slots, positional, positions, valid)

    def layer_weights(self, index: int) -> Params | None:
        """Layer `index`'s own weights for several `layer` calls in a row (dispatched): a
        call given them does not copy them out of the stacked arrays itself (on a GPU each
        call of a traced layer index did, a cost that adds up over a step's layers).
        None on CPU, where each layer's weights are views already."""
        return None if self.views else self._take(self.params, self.indices[index])

    def layer(self, index: int, pool: KVPages, filling: FillingPages, table_pages: jax.Array,
              x: jax.Array, inputs: tuple, meta: TokenMeta | None = None,
              slot_tiers: tuple | None = None, weights: Params | None = None) -> tuple:
        """Layer `index` of a call (`embed`'s inputs): (x, pool, filling, meta); dispatched.
        `weights`: its own (`layer_weights`), else taken from the params."""
        slots, positional, positions, valid = inputs
        if weights is None:
            weights = self.views[index] if self.views else self.params
        return self._layer(weights, pool, filling, meta, table_pages, slot_tiers, slots, x,
                           positional, positions, valid, self.indices[index])

    def head(self, x: jax.Array, batch: Batch) -> tuple:
        """A call's last part after its layers: the tokens sampled (as `run`'s first part,
        without targets); dispatched."""
        return self._head(self.params, x, batch.positions, batch.valid, self.sketch,
                          *batch.sampling)
