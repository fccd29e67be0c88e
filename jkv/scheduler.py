"""The serving loop around the scheduling policy: `Scheduler` keeps the waiting and running
requests, asks `jkv.planning` what the next step does (`plan_step`) and whether a waiting
request's store hit is restored (`plan_restore`), applies those decisions (engine slots,
preemption, restores, statistics), runs the engine step and hands each new token to its
request. The policies themselves are described in `jkv.planning`.

`Request` is what a caller gives and reads (prompt, sampling, SLOs, callbacks; outputs,
finish reason, timing); what the scheduler keeps about a request it holds (slot, PRNG key,
prompt hashes, planned restore) is its own `_Tracked` record.

With a KV store (`jkv.store.KVStore`): a waiting request's prompt is also looked up in the
store; blocks found there past the device prefix cache's hit count as held (their pages as
pages admission takes) and are restored into the pool when it is admitted, unless restore
planning expects recomputing them to be faster; the store gets the waiting queue as its
prefetch/eviction hint every step, and a finishing request's full blocks are handed to the
store's write-behind. Under token tiers a kept or stored row is whole: a stored one is
restored only into an empty slot, never past a device hit.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from jkv.config import SchedulerConfig, StoreConfig
from jkv.engine import Engine, Row, Sampled, SavedPages
from jkv.layer_major import layers_for
from jkv.planning import (
    Budget,
    Candidate,
    OutputLengths,
    RestoreDecision,
    RestoreRates,
    min_resident,
    plan_restore,
    plan_step,
    queue_order,
)
from jkv.sampling import SamplingParams
from jkv.step_costs import StepCosts
from jkv.store.store import Hit, KVStore

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Truncation:
    """A prompt made by dropping the oldest turns of a conversation (session mode): it is
    `source[:keep] + source[keep + drop:]`. The store's KV of `source` is reused for it by
    re-rotating the kept tokens to their new positions (`Engine.rebase`)."""

    source: tuple[int, ...]
    keep: int
    drop: int



@dataclass(eq=False)
class Request:
    """A request as its caller gives it and reads it back (the scheduler's own per-request
    state is kept apart, in `_Tracked`). `on_token(request, token)` sees every new token and
    returns True when the request is finished (a stop string, say); `on_finish(request)` is
    called once at the end. Both run on the thread that calls `Scheduler.step`."""

    prompt: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    priority: int = 0
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    session_id: str | None = None
    truncation: Truncation | None = None  # how the prompt was cut from a longer history
    deadline: float | None = None  # time.monotonic() after which it is aborted
    on_token: Callable[[Request, int], bool] | None = None
    on_finish: Callable[[Request], None] | None = None
    arrival: float = field(default_factory=time.monotonic)

    output: list[int] = field(default_factory=list)
    # per output token, when sampling.logprobs is set: (logprob, top ids, top logprobs)
    logprobs: list[tuple[float, list[int], list[float]]] = field(default_factory=list)
    # per prompt token, when sampling.prompt_logprobs is set: the same (None for the first)
    prompt_logprobs: list[tuple[float, list[int], list[float]] | None] = field(
        default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort", "timeout" or "error"
    admit_time: float | None = None  # first given a slot: arrival to here is its queueing
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    cancelled: bool = False  # set from any thread; the loop aborts it at its next step

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class _Tracked:
    """What the scheduler keeps about a request from its first step to its finish; callers
    never see it, so it can change with the scheduler."""

    key: np.ndarray  # its PRNG key
    slot: int | None = None
    num_computed: int = 0  # tokens whose KV its slot holds
    computed_before: int = 0  # num_computed when it was last preempted
    hashes: list[bytes] | None = None  # its prompt's block hashes (until preempted)
    source_hashes: list[bytes] | None = None  # its truncation source's block hashes
    hit: Hit | None = None  # the store's blocks admission restores (this step's plan)
    cached: int = 0  # tokens the plan found on the device (admission takes no more)
    rebase: int = 0  # blocks `hit` gives after re-rotation
    declined: bool = False  # recomputing its hit was planned (counted once)
    probe: bool = False  # restore its hit anyway, to measure
    recompute: float = 0.0  # share of `hit` recomputed while the rest loads (a split)
    read_since: float | None = None  # when it began waiting for its hit's read ahead
    abandoned: bool = False  # its read took longer than recomputing: recomputed
    resident: int | None = None  # layers admission keeps in the pool (None: all)
    held: bool = False  # an admission with layers on the host was held back (counted once)
    layers_done: int | None = None  # its prompt fed layer-major: the layers run (None: not)
    saved: int = 0  # blocks of its run last queued for the store (decode saves by interval)


@dataclass
class SchedulerStats:
    preemptions: int = 0
    recomputed_tokens: int = 0  # tokens computed again after a preemption
    finished: int = 0
    aborted: int = 0
    restored_tokens: dict = field(default_factory=lambda: {"host": 0, "disk": 0})
    store_misses: int = 0  # store hits that could not be restored (gone, corrupt): recomputed
    restores_declined: int = 0  # store hits recomputed because that was expected faster
    rebased_tokens: int = 0  # restored tokens re-rotated for a truncated conversation
    restores_abandoned: int = 0  # hits whose read outlasted recomputing them: recomputed
    layers_offloaded: int = 0  # running requests' layers moved to the host (LayerKV)
    layer_fetches: int = 0  # running requests whose offloaded layers came back
    admitted_offloaded: int = 0  # requests admitted with some layers on the host
    layer_major_prefills: int = 0  # of those, prompts fed layer-major (`jkv.layer_major`)
    # requests whose admission waited (pages fitting) for a running request's TPOT
    admissions_held: int = 0
    # finished requests that missed their TTFT / TPOT target (counted once each), and those
    # that ended normally meeting every target they had (goodput)
    slo_violations: dict = field(default_factory=lambda: {"ttft": 0, "tpot": 0})
    slo_met: int = 0


READ_POLL_S = 0.005  # an idle step waits this long for a read ahead before returning
FORECAST_STEPS = 4  # layer offload (LayerKV eq. 5): decodes' pages over this many steps


class Scheduler:
    """The serving loop's state. `add` and `abort` may be called from any thread; `step`
    from one thread only."""

    def __init__(self, engine: Engine, config: SchedulerConfig | None = None,
                 store: KVStore | StoreConfig | None = None) -> None:
        self.engine = engine
        self.config = config or SchedulerConfig()
        if isinstance(store, StoreConfig):  # a store for this engine's KV
            store = KVStore(store, model=engine.fingerprint, kv_format=engine.kv_format,
                            page_size=engine.page_size,
                            aligned_reads=engine.aligned_host_arrays)
        self.store = store
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._incoming: list[Request] = []
        self._state: dict[Request, _Tracked] = {}  # every request it holds past `add`
        self.costs = StepCosts(engine.runner.rows_bucket)  # learned from each step
        self._next_step_s = 0.0  # what the next step of the decoding requests will take
        self.lengths = OutputLengths()  # finished replies' lengths: TPOT slack
        # LayerKV's layer-wise offload, where the engine's pages are blocks
        self.layer_offload = self.config.layer_offload and engine.layers is not None

    def add(self, request: Request) -> None:
        """Queue a request. A prompt that cannot fit the model's context is a ValueError."""
        n, limit = len(request.prompt), self.engine.max_model_len
        if n < 1:
            raise ValueError("prompt is empty")
        if n >= limit:
            raise ValueError(f"prompt has {n} tokens; the context holds {limit} and at least "
                             f"one token must be generated")
        with self._wake:
            self._incoming.append(request)
            self._wake.notify()

    def close(self) -> None:
        """Close the store (its queued saves are written); call after the loop stopped."""
        if self.store is not None:
            self.store.close()

    def abort(self, request: Request) -> None:
        """Stop a request at the next step; its pages are freed there."""
        request.cancelled = True
        self.wake()

    def wake(self) -> None:
        """Get `serve` out of its idle wait (after `abort`, or to see its stop event)."""
        with self._wake:
            self._wake.notify()

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return len(self.waiting) + len(self._incoming)

    def serve(self, stop: threading.Event) -> None:
        """Step while there is work, sleep while there is none, until `stop` is set. An
        error in a step fails the requests in flight, not the loop."""
        while not stop.is_set():
            with self._wake:
                if not (self._incoming or self.waiting or self.running):
                    self._wake.wait(0.5)
                    continue
            try:
                self.step()
            except Exception:
                log.exception("a scheduler step failed; failing the requests in flight")
                self._fail_all("error")

    def stop_all(self, reason: str = "abort") -> None:
        """Finish every request now (shutdown); call from the loop's thread or after it."""
        with self._lock:
            self.waiting += self._incoming
            self._incoming = []
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        for r in self.waiting + self.running:
            if not r.finished:
                try:
                    self._finish(r, reason)
                except Exception:  # the engine may be what failed: free what can be freed
                    log.exception("could not finish request %s cleanly", r.request_id)
                    r.finish_reason = reason
        self.waiting, self.running = [], []

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self.waiting) + len(self.running) + len(self._incoming)

    def snapshot(self) -> dict:
        """The serving figures as plain numbers (`LLM.stats()`, `/metrics`)."""
        eng, st = self.engine, self.engine.stats
        finished = eng.cache.finished
        with self._lock:
            waiting = len(self.waiting) + len(self._incoming)
        out = {
            "num_requests_running": len(self.running),
            "num_requests_waiting": waiting,
            "kv_pages_used": eng.cache.pages_used,
            "kv_pages_total": eng.cache.total_pages,
            "kv_pages_cached": eng.cache.pages_cached,
            "prefix_hit_tokens": {"device": st.prefix_hit_tokens, **self.stats.restored_tokens},
            "prefix_query_tokens": st.prefix_query_tokens,
            "recomputed_tokens": self.stats.recomputed_tokens,
            "preemptions": self.stats.preemptions,
            "compilations": eng.num_compiles,
            "prompt_tokens_computed": st.prefill_tokens,
            "generation_tokens": st.decode_tokens,
            "steps": st.steps,
            "requests_finished": self.stats.finished,
            "requests_aborted": self.stats.aborted,
            # requests that ended normally: those that missed a target, by kind, and those
            # that kept every target they had (goodput; a request with none counts)
            "slo_violations": dict(self.stats.slo_violations),
            "requests_within_slo": self.stats.slo_met,
            # what the pool held per token of context as each sequence ended (all layers and
            # KV heads, scales included), averaged; tokens per tier, summed
            "kv_bytes_per_token": finished.bytes_per_token / max(finished.sequences, 1),
            "kv_tiers": dict(finished.tokens),
            "kv_compactions_refused": eng.cache.tier_refusals,  # the pool was short
            # restored prompt tokens: loaded, or recomputed by split restores (per layer)
            "restore": {"tokens_loaded": st.restored_tokens - st.recomputed_tokens,
                        "tokens_recomputed": st.recomputed_tokens,
                        "recompute_ratio": st.recomputed_tokens / max(st.restored_tokens, 1)},
        }
        if eng.layers is not None:  # LayerKV's layer-wise offload
            out["layer_offload"] = {
                "enabled": self.layer_offload,
                "layers_offloaded": self.stats.layers_offloaded,
                "fetches": self.stats.layer_fetches,
                "admitted_offloaded": self.stats.admitted_offloaded,
                "layer_major_prefills": self.stats.layer_major_prefills,
                "admissions_held": self.stats.admissions_held,
                "bytes_to_host": eng.layers.offloaded_bytes,
                "bytes_from_host": eng.layers.fetched_bytes,
                # (read from other threads: a request may have just finished, its state
                # gone while the loop still lists it)
                "requests_offloaded": sum(
                    1 for r in list(self.running)
                    if (t := self._state.get(r)) is not None and t.slot is not None
                    and eng.offloaded_layers(t.slot))}
        if self.store is not None:
            out["store"] = {**self.store.snapshot(), "misses": self.stats.store_misses,
                            "restores_declined": self.stats.restores_declined,
                            "rebased_tokens": self.stats.rebased_tokens,
                            "restores_abandoned": self.stats.restores_abandoned}
        return out

    # ------------------------------------------------------------------ one step

    def _candidate(self, r: Request, held: int, pin_pages: int) -> Candidate:
        ttft = (None if r.ttft_slo_ms is None or r.output
                else r.arrival + r.ttft_slo_ms / 1000)
        tpot = None if r.tpot_slo_ms is None else r.tpot_slo_ms / 1000
        # (what admission weighs the cost of its steps over)
        remaining = self.lengths.remaining(r.session_id, r.sampling.max_tokens, len(r.output))
        return Candidate(r.request_id, r.arrival, len(r.tokens) - held, held,
                         self._state[r].slot is not None, r.priority, pin_pages, ttft, tpot,
                         remaining=remaining)

    def _running(self, r: Request, now: float) -> Candidate:
        st, cache = self._state[r], self.engine.cache
        c = self._candidate(r, st.num_computed, cache.pages_freed_by_close(st.slot))
        if self.layer_offload:
            resident = cache.resident(st.slot)
            mid_prompt = st.layers_done is not None  # (its layers move only once it is done)
            c = dataclasses.replace(
                c, resident=None if resident == cache.num_layers else resident,
                offload_pages=0 if mid_prompt else cache.pages_offloadable(st.slot),
                fetch_pages=0 if mid_prompt else self.engine.pages_to_fetch(st.slot),
                layer_major=st.layers_done)
        if c.tpot_slo is not None and r.first_token_time is not None and self._next_step_s:
            # LayerKV eq. 1: what its target allows over the whole output, less what it has
            # used and what its remaining tokens' decode steps will take (each as long as a
            # step of the requests decoding now, layers brought in included)
            m = self.lengths.remaining(r.session_id, r.sampling.max_tokens, len(r.output))
            slack = ((len(r.output) - 1 + m) * c.tpot_slo - (now - r.first_token_time)
                     - m * self._next_step_s)
            c = dataclasses.replace(c, tpot_slack=slack, remaining=m)
        return c

    def _waiting(self, r: Request, rates: RestoreRates, declined: int, now: float
                 ) -> tuple[Candidate, RestoreDecision, int, bool]:
        """`r` as the policy sees it, with the restore planned for it (not yet applied), the
        tokens found on the device, and whether it may be admitted now: its prompt is looked
        up in the device prefix cache (kept tiered sequences under token tiers), then in the
        store, whose entry is read ahead (`KVStore.read_ahead`) while it waits."""
        eng, st = self.engine, self._state[r]
        if r.sampling.prompt_logprobs is not None:  # every prompt token is computed
            return self._candidate(r, 0, 0), RestoreDecision(0), 0, True
        if st.hashes is None:
            st.hashes = eng.cache.prompt_hashes(r.tokens)
        cached, pinned = eng.cache.lookup(st.hashes)
        decision = RestoreDecision(cached)
        if st.abandoned:
            pass
        elif self.store is not None and eng.tiered and not cached:
            # a tiered row restores whole into an empty slot, never moved (no rebase)
            decision = plan_restore(
                0, self.store.lookup(st.hashes, whole=True), None, rates,
                cost=eng.cache.cost, planning=self.config.restore_planning, declined=st.declined,
                probe=st.probe, declined_count=declined)
        elif self.store is not None and not eng.tiered:
            decision = plan_restore(
                cached, self.store.lookup(st.hashes), self._truncated_hit(r), rates,
                cost=eng.cache.cost, planning=self.config.restore_planning, declined=st.declined,
                probe=st.probe, declined_count=declined)
        ready = (decision.hit is None or not self.config.store_read_ahead
                 or self.store.read_ahead(decision.hit))
        if ready:
            st.read_since = None
        else:  # its read is under way: it waits, unless recomputing would be done by now
            st.read_since = now if st.read_since is None else st.read_since
            recompute_s = (decision.held - cached) * self.costs.prefill_token_s
            if (self.config.restore_planning and recompute_s
                    and now - st.read_since > recompute_s):
                st.abandoned, ready = True, True
                self.stats.restores_abandoned += 1
                decision = RestoreDecision(cached)
        c = self._candidate(r, decision.held, pinned + decision.extra_pages)
        if self.layer_offload and eng.layer_major is not None:  # (fed so if admitted offloaded)
            c = dataclasses.replace(c, layer_major=0)
        return (c, decision,
                cached, ready)

    def _truncated_hit(self, r: Request) -> tuple[Hit, int] | None:
        """For a truncated prompt: the store's entry of its untruncated source and how many
        of the prompt's blocks it gives once moved (None when it gives none)."""
        t = r.truncation
        if t is None:
            return None
        eng = self.engine
        tokens, k, d = r.tokens, t.keep, t.drop
        if (k > len(tokens) or list(t.source[:k]) != tokens[:k]
                or list(t.source[k + d: len(tokens) + d]) != tokens[k: len(t.source) - d]):
            return None  # not a cut of its source: nothing to move
        st = self._state[r]
        if st.source_hashes is None:
            st.source_hashes = eng.cache.prompt_hashes(list(t.source))
        hit = self.store.lookup(st.source_hashes)
        if hit is None:
            return None
        ps = eng.page_size
        blocks = min((hit.blocks * ps - t.drop) // ps, (len(r.tokens) - 1) // ps)
        return (hit, blocks) if blocks * ps > t.keep else None

    def _open(self, r: Request) -> int:
        """Give `r` a slot; its held prefix comes from the device prefix cache and, for a
        store hit, from the store (a hit that cannot be loaded is recomputed)."""
        eng, st = self.engine, self._state[r]
        hit, restore = st.hit, None
        if hit is not None:
            try:
                if self.config.store_read_ahead:
                    loaded = self.store.take(hit)  # read ahead while it waited
                else:  # read here, the step waiting
                    loaded = self.store.load(hit)
                    loaded = None if loaded is None else (*loaded, hit.tier)
                if loaded is not None:
                    *loaded, tier = loaded
                    hit = hit._replace(tier=tier)  # counted where it was read from
                    restore = SavedPages(hit.blocks, *loaded)
                    if st.rebase:
                        t = r.truncation
                        restore = eng.rebase(restore, r.tokens, t.keep, t.drop)
            except Exception:  # a failed load or move is a miss, never a failed step
                log.exception("could not restore request %s from the store", r.request_id)
                restore = None
            if restore is None:
                self.stats.store_misses += 1
        before = eng.stats.restored_tokens
        try:
            # no more of the device cache than planned: a row kept by this step's own
            # preemption was not in the plan's page count
            st.slot, cached = eng.open(r.tokens, restore=restore,
                                       use_prefix_cache=r.sampling.prompt_logprobs is None,
                                       max_cached=st.cached, recompute=st.recompute,
                                       resident=st.resident)
        except ValueError:  # the loaded blocks do not fit this prompt: never serve them
            log.exception("restoring request %s from the store failed; recomputing",
                          r.request_id)
            self.stats.store_misses += 1
            st.slot, cached = eng.open(r.tokens, max_cached=st.cached, resident=st.resident)
        if st.resident is not None:
            self.stats.admitted_offloaded += 1
        if hit is not None:
            restored = eng.stats.restored_tokens - before
            self.stats.restored_tokens[hit.tier] += restored
            if st.rebase:
                self.stats.rebased_tokens += restored
        st.hit, st.rebase, st.recompute, st.resident = None, 0, 0.0, None
        return cached

    def _save(self, r: Request, slot: int) -> None:
        """Hand `r`'s full blocks to the store's write-behind, only those after the run the
        store already has or has queued (never fails the request)."""
        try:
            hashes = self.engine.saved_hashes(slot)
            start = self.store.tail_start(hashes)
            if not self.engine.tiered and start == len(hashes):
                return  # nothing new (a tiered row is saved whole)
            saved = self.engine.gather(slot, start)
            self.store.save(saved.num_blocks, saved.arrays, saved.hashes, r.session_id,
                            rows=saved.rows, start=saved.start)
        except Exception:
            log.exception("could not queue request %s's KV for the store", r.request_id)

    def _save_decoding(self, decoded: Sequence[Request]) -> None:
        """Requests still decoding whose blocks have grown by the store's save interval
        since their last save queue the new ones (CachedAttention: saving as KV is made,
        not all at the finish)."""
        every = self.store.config.save_interval_blocks
        if not every or self.engine.tiered:
            return
        page = self.engine.cache.page_size
        for r in decoded:
            st = self._state.get(r)
            full = 0 if st is None else st.num_computed // page
            if st is not None and not r.finished and full - st.saved >= every:
                # tried again only after another interval, whatever this save covered (a
                # restored history's moved blocks are never saved; a failure is logged)
                self._save(r, st.slot)
                st.saved = full

    def _finish(self, r: Request, reason: str) -> None:
        st = self._state.pop(r, None)  # none yet for a request `stop_all` took from incoming
        if st is not None and st.slot is not None:
            if self.store is not None and reason != "error":
                self._save(r, st.slot)
            # after a failed step its KV is suspect: nothing of it is kept
            self.engine.close(st.slot, keep=reason != "error")
        r.finish_reason, r.finish_time = reason, time.monotonic()
        self.stats.finished += 1
        if reason in ("abort", "timeout", "error"):
            self.stats.aborted += 1
        else:
            self._count_slo(r)
            self.lengths.add(r.session_id, len(r.output))
        if r.on_finish is not None:
            r.on_finish(r)

    def _count_slo(self, r: Request) -> None:
        """A request that ended normally: did it keep its TTFT and TPOT targets?"""
        missed = False
        if r.ttft_slo_ms is not None and r.first_token_time is not None and (
                r.first_token_time - r.arrival > r.ttft_slo_ms / 1000):
            self.stats.slo_violations["ttft"] += 1
            missed = True
        if r.tpot_slo_ms is not None and len(r.output) > 1 and (
                (r.finish_time - r.first_token_time) / (len(r.output) - 1)
                > r.tpot_slo_ms / 1000):
            self.stats.slo_violations["tpot"] += 1
            missed = True
        self.stats.slo_met += not missed

    def _emit(self, r: Request, sampled: Sampled, now: float) -> None:
        token = sampled.token
        r.output.append(token)
        if r.sampling.logprobs is not None:
            n = r.sampling.logprobs
            r.logprobs.append((sampled.logprob, sampled.top_ids[:n].tolist(),
                               sampled.top_logprobs[:n].tolist()))
        if r.first_token_time is None:
            r.first_token_time = now
        stop = r.on_token(r, token) if r.on_token is not None else False
        if stop:
            self._finish(r, "stop")
        elif (len(r.output) >= r.sampling.max_tokens
              or len(r.tokens) >= self.engine.max_model_len):
            self._finish(r, "length")

    def step(self) -> list[Request]:
        """Run one step; returns the requests that finished in it."""
        with self._lock:
            new, self._incoming = self._incoming, []
            self.waiting += new
        for r in new:
            self._state[r] = _Tracked(self.engine.request_key(r.sampling.seed))
        finished: list[Request] = []
        now = time.monotonic()
        for r in self.waiting + self.running:
            if r.cancelled or (r.deadline is not None and now > r.deadline):
                self._finish(r, "abort" if r.cancelled else "timeout")
                finished.append(r)
        self.waiting = [r for r in self.waiting if not r.finished]
        self.running = [r for r in self.running if not r.finished]
        if not self.waiting and not self.running:
            return finished

        eng = self.engine
        by_id = {r.request_id: r for r in self.waiting + self.running}
        decoding = [self._state[r].slot for r in self.running if r.output]
        self._next_step_s = self.costs.step(
            len(decoding), sum(len(eng.offloaded_layers(s)) for s in decoding))
        budget = Budget(
            available_pages=eng.cache.available_pages, free_slots=eng.cache.num_free_slots,
            max_tokens=self.config.max_num_batched_tokens or eng.prefill_chunk,
            chunk=eng.prefill_chunk, cost=eng.cache.cost,
            now=now, decode_step_seconds=self._next_step_s,
            prefill_token_seconds=self.costs.prefill_token_s, layer_offload=self.layer_offload,
            offload_layer_seconds=self.costs.offload_layer_s,
            decode_step_by_rows=tuple(self.costs.decode(n)
                                      for n in range(eng.runner.max_rows + 1)),
            min_resident=min_resident(
                eng.cfg.num_layers, eng.cache.one_page * eng.cfg.num_kv_heads / eng.page_size,
                0.0 if eng.layers is None else eng.layers.offload_bytes_per_s,
                self.costs.prefill_token_s),
            forecast_steps=FORECAST_STEPS)
        rates = RestoreRates({} if self.store is None else self.store.read_bytes_per_s,
                             eng.connector.load_bytes_per_s, self.costs.prefill_token_s,
                             eng.split_overlap)
        waiting, queued, decisions, cached = [], [], {}, {}
        declined = self.stats.restores_declined
        for r in self.waiting:
            c, decisions[r.request_id], cached[r.request_id], ready = self._waiting(
                r, rates, declined, now)
            declined += decisions[r.request_id].newly_declined
            queued.append(c)
            if ready:  # a request still waiting for its read ahead is not admitted yet
                waiting.append(c)
        plan = plan_step([self._running(r, now) for r in self.running], waiting, budget)
        for r in self.waiting:  # the restores planned: what admission loads, the hint, stats
            st, d = self._state[r], decisions[r.request_id]
            st.hit, st.rebase, st.probe, st.recompute = d.hit, d.rebase, d.probe, d.recompute
            st.cached = cached[r.request_id]
            if d.newly_declined:
                st.declined = True
                self.stats.restores_declined += 1
        if self.store is not None:
            order = [decisions[c.request_id].hit for c in sorted(queued, key=queue_order)]
            self.store.hint([hit.key for hit in order if hit is not None])
            self.store.drop_reads({hit for hit in order if hit is not None})

        for rid in plan.held:
            st = self._state[by_id[rid]]
            self.stats.admissions_held += not st.held
            st.held = True
        for rid, keep in plan.offload.items():  # before preemptions reuse pages
            self.stats.layers_offloaded += eng.keep_resident(self._state[by_id[rid]].slot, keep)
        for rid in plan.preempt:
            r = by_id[rid]
            st = self._state[r]
            st.computed_before = st.num_computed
            if self.store is not None:  # what it holds, saved before its pages are reused
                self._save(r, st.slot)
            eng.close(st.slot, finished=False)
            st.slot, st.num_computed, st.hashes, st.saved = None, 0, None, 0
            st.read_since, st.abandoned, st.layers_done = None, False, None
            r.num_preemptions += 1
            self.stats.preemptions += 1
            self.running.remove(r)
            self.waiting.append(r)
        for rid in plan.fetch:
            eng.fetch_layers(self._state[by_id[rid]].slot)
            self.stats.layer_fetches += 1
        for rid in plan.admit:
            r = by_id[rid]
            st = self._state[r]
            st.resident = plan.resident.get(rid)
            st.layers_done = 0 if rid in plan.layer_major else None
            self.stats.layer_major_prefills += st.layers_done is not None
            st.num_computed = self._open(r)
            if r.admit_time is None:
                r.admit_time = now
            self.stats.recomputed_tokens += max(0, st.computed_before - st.num_computed)
            st.computed_before = 0
            self.waiting.remove(r)
            self.running.append(r)

        prefill, decode, work = [], [], []  # work: each prefill row's tokens of compute
        for rid, n in plan.prefill:
            r = by_id[rid]
            st = self._state[r]
            work.append(n)
            if st.layers_done is not None:  # its whole prompt through the layers n buys
                rest, done = r.tokens[st.num_computed:], st.layers_done
                k = layers_for(n, len(rest), eng.cfg.num_layers, done)
                prefill.append((r, Row(st.slot, rest, r.sampling, st.key, len(r.output),
                                       layers=(done, done + k))))
                continue
            chunk = r.tokens[st.num_computed: st.num_computed + n]
            targets = None
            if r.sampling.prompt_logprobs is not None:  # each position's next prompt token
                after = r.prompt[st.num_computed + 1: st.num_computed + n + 1]
                targets = list(after) + [-1] * (n - len(after))
            prefill.append((r, Row(st.slot, chunk, r.sampling, st.key, len(r.output),
                                   targets)))
        for rid in plan.decode:
            r = by_id[rid]
            st = self._state[r]
            decode.append((r, Row(st.slot, r.tokens[-1:], r.sampling, st.key, len(r.output))))
        if not prefill and not decode:
            if len(queued) > len(waiting):  # only reads ahead to wait for: no step to hold up
                self.store.wait_reads(READ_POLL_S)
            return finished
        # (a layer-major prompt brings its layers once for all its tokens: not counted)
        brings = sum(len(eng.offloaded_layers(row.slot)) for _, row in prefill + decode
                     if row.layers is None)
        t0 = time.perf_counter()
        out_p, out_d = eng.step([row for _, row in prefill], [row for _, row in decode])
        self.costs.learn(time.perf_counter() - t0, sum(work), len(decode), brings)
        now = time.monotonic()
        for (r, row), sampled in zip(prefill, out_p, strict=True):
            st = self._state[r]
            if row.layers is not None:
                st.layers_done = None if sampled is not None else row.layers[1]
                if sampled is None:
                    continue
            if sampled.positions is not None:
                self._prompt_logprobs(r, st.num_computed, sampled.positions)
            st.num_computed += len(row.tokens)
            if st.num_computed == len(r.tokens):  # the chunk ended the pending tokens
                self._emit(r, sampled, now)
        for (r, _), sampled in zip(decode, out_d, strict=True):
            self._state[r].num_computed += 1
            self._emit(r, sampled, now)
        if self.store is not None and decode:
            self._save_decoding([r for r, _ in decode])
        for r in self.running:
            if r.finished:
                finished.append(r)
        self.running = [r for r in self.running if not r.finished]
        return finished

    @staticmethod
    def _prompt_logprobs(r: Request, first: int, positions: tuple) -> None:
        """Record what a chunk fed from position `first` gave for the prompt tokens after
        each of its positions."""
        k = r.sampling.prompt_logprobs
        if not r.prompt_logprobs:
            r.prompt_logprobs = [None] * len(r.prompt)
        for i, (lp, ids, lps) in enumerate(zip(*positions, strict=True)):
            p = first + i + 1
            if p < len(r.prompt):
                r.prompt_logprobs[p] = (float(lp), ids[:k].tolist(), lps[:k].tolist())


def generate_all(scheduler: Scheduler, requests: Sequence[Request]) -> None:
    """Run `requests` to completion on this thread (the offline path)."""
    for r in requests:
        scheduler.add(r)
    while scheduler.num_unfinished:
        scheduler.step()


__all__ = ["Request", "Scheduler", "SchedulerStats", "Truncation", "generate_all"]
