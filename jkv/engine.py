"""One batch of requests through the model over the paged KV cache.

The engine owns the page pool and the page tables, pads every step to a shape bucket
(batch, tokens, page-table width are powers of two) so a steady workload reuses compiled
steps, prefills long prompts in chunks, and decodes until every request is finished.
Which requests form a batch, and when one stops, is the caller's business.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jkv.cache.page_pool import (
    FillingPages,
    init_filling,
    init_pool,
    init_tables,
    page_bytes,
    release,
    reserve,
)
from jkv.config import ATTENTION_BACKENDS, CacheConfig, ModelConfig
from jkv.models.llama import Params, forward, lm_head
from jkv.sampling import SamplingParams, sample


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return 1 << max(0, math.ceil(math.log2(max(n, minimum, 1))))


def _step(params, pool, filling, pages, tokens, positions, valid, last_idx, base_keys,
          num_generated, temperature, top_p, top_k, *, cfg: ModelConfig, backend: str):
    b = tokens.shape[0]
    rows = FillingPages(k=filling.k[:b], v=filling.v[:b])
    hidden, pool, rows = forward(params, cfg, tokens, positions, valid, pool, rows, pages,
                                 backend)
    filling = FillingPages(k=filling.k.at[:b].set(rows.k), v=filling.v.at[:b].set(rows.v))
    h_last = jnp.take_along_axis(hidden, last_idx[:, None, None], axis=1)[:, 0]
    keys = jax.vmap(jax.random.fold_in)(base_keys, num_generated)  # one stream per request
    tokens = sample(lm_head(params, h_last), keys, temperature, top_p, top_k)
    return tokens, pool, filling


@dataclass
class EngineStats:
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    step_shapes: set = field(default_factory=set)  # (batch, tokens, width) buckets compiled


class Engine:
    """Runs batches of token-id prompts; see `generate`."""

    def __init__(self, cfg: ModelConfig, params: Params, *, cache: CacheConfig,
                 max_model_len: int, max_num_seqs: int = 8, attention_backend: str = "xla",
                 prefill_chunk: int = 512, seed: int = 0) -> None:
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {attention_backend!r}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if prefill_chunk < 1 or prefill_chunk & (prefill_chunk - 1):
            raise ValueError(f"prefill_chunk must be a power of two, got {prefill_chunk}")
        self.cfg, self.params = cfg, params
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.prefill_chunk = prefill_chunk
        self.page_size = cache.page_size
        dtype = params["embed"].dtype
        one_page = page_bytes(cache.kv_format, cache.page_size, cfg.head_dim, dtype)
        num_pages = cache.kv_cache_bytes // one_page
        self.max_pages = bucket(-(-max_model_len // cache.page_size), 4)  # table width
        one_seq = self.pages_for(max_model_len)
        if num_pages - 1 < one_seq:
            raise ValueError(
                f"kv_cache_bytes={cache.kv_cache_bytes} holds {num_pages} pages but one "
                f"sequence of max_model_len={max_model_len} needs {one_seq}; raise "
                f"kv_cache_bytes to at least {(one_seq + 1) * one_page} or lower max_model_len")
        self.pool, self.free = init_pool(num_pages, cache.page_size, cfg.head_dim, dtype,
                                         cache.kv_format)
        self.filling = init_filling(max_num_seqs, cfg.num_layers, cfg.num_kv_heads,
                                    cache.page_size, cfg.head_dim, dtype)
        # committed like the step's outputs, so the first call compiles what later ones reuse
        self.pool, self.filling = jax.device_put((self.pool, self.filling), jax.devices()[0])
        self.tables = init_tables(max_num_seqs, cfg.num_layers, cfg.num_kv_heads, self.max_pages)
        self.free_pages = num_pages - 1  # host mirror of free.num_free
        self._step = jax.jit(partial(_step, cfg=cfg, backend=attention_backend),
                             donate_argnums=(1, 2))
        self._rng = jax.random.PRNGKey(seed)
        self._requests_seen = 0
        self.stats = EngineStats()

    @property
    def num_compiles(self) -> int:
        """Compiled variants of the step function (a steady workload must not add any)."""
        return self._step._cache_size()

    def pages_for(self, num_tokens: int) -> int:
        """Pages one sequence of `num_tokens` tokens occupies across all layers and KV heads."""
        return -(-num_tokens // self.page_size) * self.cfg.num_layers * self.cfg.num_kv_heads

    def _width(self, num_tokens: int) -> int:
        return min(bucket(-(-num_tokens // self.page_size), 4), self.max_pages)

    def _reserve(self, new_lengths: np.ndarray) -> jax.Array:
        padded = np.zeros(self.max_num_seqs, np.int32)
        padded[: len(new_lengths)] = new_lengths
        self.free, self.tables, ok = reserve(self.free, self.tables, jnp.asarray(padded))
        return ok

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sequence[SamplingParams],
                 on_token: Callable[[int, int], bool]) -> None:
        """Prefill `prompts` together, then decode until `on_token` has finished them all.

        on_token(i, token) is called for every token produced for prompt i and returns True
        when that request is finished. A request also ends at `max_tokens` or when the
        context is full. Pages are released however the call ends.
        """
        n = len(prompts)
        if not 1 <= n <= self.max_num_seqs:
            raise ValueError(f"a batch holds 1..{self.max_num_seqs} prompts, got {n}")
        plen = np.array([len(p) for p in prompts], np.int32)
        if plen.min() < 1:
            raise ValueError("every prompt needs at least one token")
        if plen.max() >= self.max_model_len:
            raise ValueError(f"a prompt of {plen.max()} tokens leaves no room to generate "
                             f"within max_model_len={self.max_model_len}")
        max_new = np.array([min(s.max_tokens, self.max_model_len - len(p))
                            for s, p in zip(sampling, prompts, strict=True)], np.int32)
        need = sum(self.pages_for(int(a + b)) for a, b in zip(plen, max_new, strict=True))
        if need > self.free_pages:
            raise ValueError(f"the batch needs {need} KV pages and {self.free_pages} are free")
        b = bucket(n)
        base_keys = []
        for s in sampling:
            if s.seed is not None:
                base_keys.append(jax.random.PRNGKey(s.seed))
            else:
                base_keys.append(jax.random.fold_in(self._rng, self._requests_seen))
                self._requests_seen += 1
        base_keys += [base_keys[0]] * (b - n)
        base_keys = jnp.stack(base_keys)
        temperature = np.zeros(b, np.float32)
        top_p = np.ones(b, np.float32)
        top_k = np.zeros(b, np.int32)
        for i, s in enumerate(sampling):
            temperature[i], top_p[i], top_k[i] = s.temperature, s.top_p, max(s.top_k, 0)
        sp = (jnp.asarray(temperature), jnp.asarray(top_p), jnp.asarray(top_k))
        self.free_pages -= need
        try:
            self._generate(prompts, plen, max_new, b, base_keys, sp, on_token)
        finally:
            mask = np.zeros(self.max_num_seqs, bool)
            mask[:n] = True
            self.free, self.tables = release(self.free, self.tables, jnp.asarray(mask))
            self.free_pages += need

    def _step_call(self, tokens, positions, valid, last_idx, base_keys, num_generated, sp,
                   upto: int):
        b, t = tokens.shape
        width = self._width(upto)
        self.stats.step_shapes.add((b, t, width))
        pages = self.tables.pages[:b, :, :, :width]
        out, self.pool, self.filling = self._step(
            self.params, self.pool, self.filling, pages, jnp.asarray(tokens),
            jnp.asarray(positions), jnp.asarray(valid), jnp.asarray(last_idx), base_keys,
            jnp.asarray(num_generated), *sp)
        return out

    def _generate(self, prompts, plen, max_new, b, base_keys, sp, on_token) -> None:
        n = len(prompts)
        first = np.zeros(n, np.int32)
        t0 = time.perf_counter()
        pos, longest = 0, int(plen.max())
        while pos < longest:
            t = min(self.prefill_chunk, bucket(longest - pos, 16))
            tokens = np.zeros((b, t), np.int32)
            for i, p in enumerate(prompts):
                piece = p[pos: pos + t]
                tokens[i, : len(piece)] = piece
            positions = np.broadcast_to(pos + np.arange(t, dtype=np.int32), (b, t)).copy()
            valid = np.zeros((b, t), bool)
            valid[:n] = positions[:n] < plen[:, None]
            last_idx = np.zeros(b, np.int32)
            last_idx[:n] = np.clip(plen - 1 - pos, 0, t - 1)
            ok = self._reserve(np.minimum(plen, pos + t))
            out = self._step_call(tokens, positions, valid, last_idx, base_keys,
                                  np.zeros(b, np.uint32), sp, pos + t)
            out, ok = jax.device_get((out, ok))
            if not ok:
                raise RuntimeError("page reservation failed although the host budget allowed it")
            ends_here = (plen - 1 >= pos) & (plen - 1 < pos + t)
            first[ends_here] = out[:n][ends_here]
            pos += t
        self.stats.prefill_tokens += int(plen.sum())
        self.stats.prefill_seconds += time.perf_counter() - t0

        t0 = time.perf_counter()
        generated = np.ones(n, np.int32)
        active = np.ones(n, bool)
        cur = first
        for i in range(n):
            if on_token(i, int(cur[i])) or generated[i] >= max_new[i]:
                active[i] = False
        decoded = 0
        while active.any():
            tokens = np.zeros((b, 1), np.int32)
            tokens[:n, 0] = cur
            positions = np.zeros((b, 1), np.int32)
            positions[:n, 0] = plen + generated - 1
            valid = np.zeros((b, 1), bool)
            valid[:n, 0] = active
            new_len = np.where(active, plen + generated, 0)
            ok = self._reserve(new_len)
            steps = np.zeros(b, np.uint32)
            steps[:n] = generated
            out = self._step_call(tokens, positions, valid, np.zeros(b, np.int32), base_keys,
                                  steps, sp, int(positions.max()) + 1)
            out, ok = jax.device_get((out, ok))
            if not ok:
                raise RuntimeError("page reservation failed although the host budget allowed it")
            cur = out[:n].astype(np.int32)
            decoded += int(active.sum())
            for i in np.flatnonzero(active):
                generated[i] += 1
                if on_token(int(i), int(cur[i])) or generated[i] >= max_new[i]:
                    active[i] = False
        self.stats.decode_tokens += decoded
        self.stats.decode_seconds += time.perf_counter() - t0
