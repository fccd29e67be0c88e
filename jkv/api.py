"""The offline library API, vLLM-style: `LLM`, `SamplingParams`, `RequestOutput` (what a
request gives back, in `jkv.outputs`)."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import textwrap
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jkv.config import (
    OPTIONS,
    PRESETS,
    CacheConfig,
    EngineConfig,
    LoadConfig,
    SchedulerConfig,
    StoreConfig,
    split_options,
)
from jkv.engine.engine import Engine
from jkv.engine.sampling import SamplingParams
from jkv.engine.warmup import Warmup
from jkv.metrics import Metrics
from jkv.models.loaders import default_model_path, random_params
from jkv.models.params_cache import load_params
from jkv.models.tokenizer import eos_token_ids, load_tokenizer
from jkv.outputs import RequestOutput, Tracker
from jkv.prompts import check_unicode, parse_messages, render, session_ids
from jkv.sched.scheduler import Request, Scheduler, Truncation, generate_all

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


def resolve_dtype(dtype: str):
    """`auto` is bfloat16 on an accelerator and float32 on CPU, where XLA's bfloat16 matmuls
    are much slower than float32 ones."""
    if dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {list(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


class LLM:
    """Load a model and generate from it.

    Every option below is a keyword argument (`LLM(max_model_len=4096, kv_format="k8v4")`;
    `model` may also come first, positionally) and a server flag (`--max-model-len`). Its
    default and help live on its field in `jkv.config` (LoadConfig, EngineConfig,
    CacheConfig, SchedulerConfig, StoreConfig); a bad value raises ValueError naming the
    field before any weights load, an unknown name TypeError.

    Finished requests' KV outlives them: on the device (prefix caching), in host memory and in
    a persistent tier (the KV store), so a later turn restores its history instead of
    recomputing it. Call `close()` (or use `with LLM(...) as llm:`) so queued saves are
    written.

    Options:
    """

    def __init__(self, model: str | os.PathLike | None = None, **options: Any) -> None:
        parts = split_options({"model": model, **options}, "LLM.__init__()")
        load = LoadConfig(**parts[LoadConfig])
        engine_config = EngineConfig(**parts[EngineConfig])
        cache = CacheConfig(**parts[CacheConfig])
        scheduler_config = SchedulerConfig(**parts[SchedulerConfig])
        store_config = StoreConfig(**parts[StoreConfig])
        path = default_model_path() if load.model is None else Path(load.model)
        self.model_path = path
        self.model_name = path.stem if path.is_file() else path.name
        if load.random_preset is not None:  # benchmarks at a real model's shapes
            self.cfg = PRESETS[load.random_preset]
            params = random_params(self.cfg, engine_config.seed, resolve_dtype(load.dtype))
            self.tokenizer, model_id = None, str(load.model)
        else:
            # split over devices: numpy weights, so each device is sent its part and no more
            self.cfg, params = load_params(path, resolve_dtype(load.dtype),
                                           use_cache=load.params_cache,
                                           on_host=engine_config.tensor_parallel > 1)
            self.tokenizer, model_id = load_tokenizer(path), str(path.resolve())
        self.max_model_len = engine_config.resolve_max_model_len(self.cfg.max_position_embeddings)
        # the engine's settings, max_model_len resolved against this model
        self.engine_config = dataclasses.replace(engine_config, max_model_len=self.max_model_len)
        self.engine = Engine(self.cfg, params, cache=cache, config=self.engine_config,
                             model_id=model_id)
        self.scheduler = Scheduler(self.engine, scheduler_config,
                                   store=store_config if store_config.enabled else None)
        self.store = self.scheduler.store  # the KV store (jkv.store.KVStore) or None
        # an LLM never closed still writes its queued saves and keeps its host tier at exit
        weakref.finalize(self, self.scheduler.close)
        self.metrics = Metrics()
        self._loop: threading.Thread | None = None
        self.warming: Warmup | None = None  # the loop's warm-up (`start_serving(warm=True)`)
        self.eos_ids = frozenset(eos_token_ids(self.tokenizer))

    # ------------------------------------------------------------------ prompts

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt given as text or as ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompts as token ids")
            check_unicode(prompt, "prompt")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = list(prompt)
            if not all(isinstance(t, int) and 0 <= t < self.cfg.vocab_size for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, "
                                 f"{self.cfg.vocab_size})")
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is "
                             f"{self.max_model_len} and at least one token must be generated")
        return ids

    def chat_prompt(self, messages: list[dict], *, max_chars: int | None = None) -> list[int]:
        """Token ids of `messages` under the model's chat template, ready for the reply; a
        ValueError naming `messages` if the template's text has more than `max_chars`
        characters (checked before tokenizing)."""
        return self.encode(self._template_ids(parse_messages(messages), max_chars))

    def _template_ids(self, messages: list[dict], max_chars: int | None = None) -> list[int]:
        text = render(self.tokenizer, messages, max_chars)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def session_prompt(self, messages: list[dict], reserve: int = 1, *,
                       max_chars: int | None = None,
                       cancelled: Callable[[], bool] | None = None
                       ) -> tuple[list[int], Truncation | None]:
        """Token ids of a session's `messages` (session mode). When they and `reserve` tokens
        to generate exceed max_model_len, the oldest turns after the leading system messages
        are dropped, whole, as few as let the prompt fit and start its kept turns with a user
        message (CachedAttention 3.4), found in a number of renders logarithmic in the turns
        (`jkv.prompts.session_ids`); the `Truncation` then says how the prompt was cut from
        the full history, so the KV stored for that history is reused, re-rotated to the new
        positions, instead of recomputed. None when nothing was dropped (or the cut is not a
        clean token splice, then the prompt is computed as any other).

        max_chars: as in `chat_prompt`, for the full history's text. cancelled: polled
        between renders; once true, `jkv.prompts.Cancelled` is raised."""
        messages = parse_messages(messages)
        ids, truncation = session_ids(messages, lambda m: self._template_ids(m, max_chars),
                                      self.max_model_len - max(reserve, 1), cancelled)
        return self.encode(ids), truncation

    # ------------------------------------------------------------------ generation

    def _tracker(self, params: SamplingParams) -> Tracker:
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= self.eos_ids
        return Tracker(self.tokenizer, params, frozenset(stop_ids))

    def run(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams],
            on_delta: Callable[[int, str], None] | None = None,
            session_id: str | None = None,
            truncation: Truncation | None = None) -> list[Tracker]:
        """Generate for token-id prompts, all of them in the scheduler at once, on this
        thread. on_delta(i, text) receives streamed text."""
        if self._loop is not None:
            raise RuntimeError("the serving loop is running (start_serving); use submit()")
        trackers = [self._tracker(p) for p in params]
        requests = [
            self._request(ids, t, None if on_delta is None else
                          (lambda text, _entries, i=i: on_delta(i, text)),
                          None, session_id=session_id, truncation=truncation)
            for i, (ids, t) in enumerate(zip(prompts, trackers, strict=True))]
        generate_all(self.scheduler, requests)
        self.metrics.sync(self.stats())
        return trackers

    # ------------------------------------------------------------------ serving

    def submit(self, ids: list[int], params: SamplingParams,
               on_delta: Callable[[str, list], None] | None = None,
               on_finish: Callable[[Tracker], None] | None = None, *,
               session_id: str | None = None, priority: int = 0,
               ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None,
               timeout_s: float | None = None,
               truncation: Truncation | None = None,
               arrival: float | None = None) -> Request:
        """Queue one token-id prompt for the serving loop (`start_serving`); returns its
        handle for `abort`. on_delta(text, logprob entries) streams text with the entries
        of the tokens since the last call (empty unless params.logprobs is set);
        on_finish(tracker) gets the result (text, token_ids, finish_reason, logprobs). Both
        run on the loop's thread. arrival: when the request arrived (`time.monotonic()`,
        default now), from which `timeout_s`, its TTFT and its queueing count, so that the
        time its prompt took to make is in them."""
        arrival = time.monotonic() if arrival is None else arrival
        deadline = None if timeout_s is None else arrival + timeout_s
        request = self._request(ids, self._tracker(params), on_delta, on_finish,
                                session_id=session_id, priority=priority,
                                ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms,
                                deadline=deadline, truncation=truncation, arrival=arrival)
        self.scheduler.add(request)
        return request

    def _request(self, ids: list[int], tracker: Tracker,
                 on_delta: Callable[[str, list], None] | None,
                 on_finish: Callable[[Tracker], None] | None, **fields) -> Request:
        """A scheduler request whose tokens go through `tracker` (detokenizing, stop strings,
        logprobs) and out as deltas; its latencies go to the metrics when it finishes."""

        def on_token(r: Request, token: int) -> bool:
            if r.logprobs:
                tracker.logprobs.append((token, *r.logprobs[-1]))
            done = tracker.add(token)
            delta = tracker.delta(final=done)
            # with no tokenizer there is no text: each token still streams (empty)
            if on_delta is not None and (delta or tracker.tokenizer is None):
                on_delta(delta, tracker.take_logprobs())
            return done

        def finished(r: Request) -> None:
            if r.prompt_logprobs:
                tracker.prompt_entries, tracker.prompt_ids = r.prompt_logprobs, r.prompt
            if tracker.finish_reason is None:
                tracker.finish_reason = r.finish_reason
                if on_delta is not None and (rest := tracker.delta(final=True)):
                    on_delta(rest, tracker.take_logprobs())
            self.metrics.observe_finished(r)
            if on_finish is not None:
                on_finish(tracker)

        return Request(list(ids), tracker.params, on_token=on_token, on_finish=finished,
                       **fields)

    def abort(self, request: Request) -> None:
        self.scheduler.abort(request)

    def warmup(self, progress: bool = True) -> int:
        """Compile every step shape the engine can run (a progress bar on stderr), so that no
        request later waits on a compilation. Returns how many compilations were new."""
        from tqdm import tqdm

        bar = tqdm(total=len(self.engine.shapes()), desc="compiling step shapes",
                   unit="shape", disable=not progress)
        with bar:
            return self.engine.warmup(lambda done, total: bar.update(done - bar.n))

    def start_serving(self, warm: bool = False) -> None:
        """Run the scheduler loop on a background thread (for `submit`); `run`, `generate`
        and `chat` must not be called until `stop_serving`. `warm`: the loop compiles the
        step shapes a lone request takes while it has no work (`self.warming`, a `Warmup`:
        its progress logged, `done` set at the end)."""
        if self._loop is not None:
            return
        self._stop = threading.Event()
        self.warming = Warmup(self.engine) if warm else None
        self._loop = threading.Thread(target=self.scheduler.serve,
                                      args=(self._stop, self.warming),
                                      name="jkv-scheduler", daemon=True)
        self._loop.start()

    @property
    def serving(self) -> bool:
        """Whether the serving loop runs (`start_serving`, and its thread is alive)."""
        return self._loop is not None and self._loop.is_alive()

    def stop_serving(self, timeout: float = 30.0) -> None:
        """Stop the loop; requests still in flight finish with reason "abort"."""
        if self._loop is None:
            return
        self._stop.set()
        self.scheduler.wake()
        self._loop.join(timeout)
        self._loop = None
        self.scheduler.stop_all("abort")

    def stats(self) -> dict:
        """Serving counters: the figures `/metrics` exports (see `jkv.metrics`). With a KV
        store, "store" holds its entries and bytes per tier and its event counters."""
        return self.scheduler.snapshot()

    def close(self) -> None:
        """Stop serving and write what the store still has queued; the host tier's entries
        move to the persistent tier as far as it has room (then another process can reuse
        them). The LLM cannot generate after this."""
        self.stop_serving()
        self.scheduler.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: str | Sequence[int] | Iterable[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for one prompt or many (text or token ids); one output per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts is empty")
        ids = [self.encode(p) for p in prompts]
        params = self._params_list(sampling_params, len(ids))
        trackers = self.run(ids, params)
        return [RequestOutput(prompt_token_ids=i, text=t.text, token_ids=t.token_ids,
                              finish_reason=t.finish_reason, logprobs=t.logprob_dicts(),
                              prompt_logprobs=t.prompt_logprob_dicts(),
                              prompt=p if isinstance(p, str) else None)
                for p, i, t in zip(prompts, ids, trackers, strict=True)]

    def chat(self, messages: list[dict],
             sampling_params: SamplingParams | None = None,
             session_id: str | None = None) -> RequestOutput:
        """Reply to a conversation (OpenAI-style messages) under the model's chat template.

        session_id names the conversation and turns on session mode: a history that outgrows
        max_model_len loses its oldest turns after the system prompt, and the stored KV of
        the turns kept is reused (`session_prompt`).
        """
        params = self._params_list(sampling_params, 1)
        truncation = None
        if session_id is None:
            ids = self.chat_prompt(messages)
        else:
            ids, truncation = self.session_prompt(messages, params[0].max_tokens)
        t = self.run([ids], params, session_id=session_id, truncation=truncation)[0]
        return RequestOutput(prompt_token_ids=ids, text=t.text, token_ids=t.token_ids,
                             logprobs=t.logprob_dicts(),
                             prompt_logprobs=t.prompt_logprob_dicts(),
                             finish_reason=t.finish_reason, session_id=session_id)

    @staticmethod
    def _params_list(sp, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} sampling_params for {n} prompts")
        return sp


def _signature() -> inspect.Signature:
    """LLM.__init__ as `OPTIONS` spell it: `model` first, the others keyword-only."""
    assert OPTIONS[0].name == "model"
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for o in OPTIONS:
        kind = (inspect.Parameter.POSITIONAL_OR_KEYWORD if o.name == "model"
                else inspect.Parameter.KEYWORD_ONLY)
        params.append(inspect.Parameter(o.name, kind, default=o.default,
                                        annotation=o.annotation))
    return inspect.Signature(params, return_annotation=None)


def _options_doc() -> str:
    """One docstring entry per option: name, default (a None one its help explains),
    choices and help."""
    entries = []
    for o in OPTIONS:
        notes = [] if o.default is None else [f"default {o.default!r}"]  # None: see help
        if o.choices:
            notes.append(f"one of {', '.join(o.choices)}")
        head = f"{o.name} ({'; '.join(notes)})" if notes else o.name
        entries.append(textwrap.fill(f"{head}: {o.help}",
                                     width=92, initial_indent="    ",
                                     subsequent_indent="        "))
    return "\n".join(entries) + "\n"


LLM.__init__.__signature__ = _signature()
LLM.__doc__ = LLM.__doc__.rstrip(" ") + _options_doc()
