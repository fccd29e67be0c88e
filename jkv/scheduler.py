"""Which requests run in the next step: continuous batching with chunked prefill, admission
under a page and token budget, preemption when pages run out, SLO-aware prefill admission.

The decision is `plan_step`, a pure function of what the queue looks like (`Candidate`s and
a `Budget`), so policies can be unit-tested and simulated without a model. `Scheduler` is the
loop around it: it keeps the waiting and running requests, turns a plan into an engine step,
and hands each new token to its request.

Policy (LayerKV's SLO-aware admission on top of vLLM's FCFS):
- order is (priority, TTFT deadline, arrival): lower priority values go first; with no
  priorities or SLOs that is first come, first served;
- running decodes always get their token; when their pages do not fit, the least important
  running request (the newest, among equals) is preempted: its pages are released (its full
  blocks stay in the prefix cache when that is on) and it is recomputed later;
- prefill tokens share a per-step budget with the decodes; partly prefilled requests continue
  before new ones are admitted; a new request is admitted only while a slot is free and its
  first chunk's pages fit;
- while running decodes carry a TPOT target, prefill tokens per step are capped so the
  estimated step time stays within the tightest target, unless a waiting request is already
  past its TTFT deadline (then both promises are broken and the oldest one wins).

With a KV store (`jkv.store.KVStore`): a waiting request's prompt is also looked up in the
store; blocks found there past the device prefix cache's hit count as held (their pages as
pages admission takes) and are restored into the pool when it is admitted; the store gets the
waiting queue as its prefetch/eviction hint every step, and a finishing request's full blocks
are handed to the store's write-behind. A hit is restored only while loading it is expected
to beat recomputing it (`restore_pays`, from measured rates), unless restore planning is off.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from jkv.averages import moving_average
from jkv.config import SchedulerConfig, StoreConfig
from jkv.engine import Engine, Row, Sampled, SavedPages
from jkv.sampling import SamplingParams
from jkv.store.store import Hit, KVStore

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- the decision


@dataclass(frozen=True)
class Candidate:
    """A request as the policy sees it."""

    request_id: str
    arrival: float
    pending: int  # tokens to feed before its next token can be sampled
    held: int  # tokens whose KV it holds (running) or would find cached (waiting)
    running: bool
    priority: int = 0
    pin_pages: int = 0  # waiting: cached pages admission pins; running: pages preemption frees
    ttft_deadline: float | None = None  # absolute seconds
    tpot_slo: float | None = None  # seconds


@dataclass(frozen=True)
class Budget:
    available_pages: int  # free pages plus unreferenced cached blocks
    free_slots: int
    max_tokens: int  # tokens per step, decode and prefill together
    chunk: int  # most tokens one request feeds in one step
    page_size: int
    block_pages: int  # pages per page_size tokens of one sequence
    now: float = 0.0
    decode_step_seconds: float = 0.0  # cost model: a step of decodes alone
    prefill_token_seconds: float = 0.0  # cost model: each prefill token on top


@dataclass
class Plan:
    preempt: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    prefill: list[tuple[str, int]] = field(default_factory=list)  # (request, tokens to feed)
    admit: list[str] = field(default_factory=list)  # waiting requests among `prefill`


def _order(c: Candidate) -> tuple:
    deadline = math.inf if c.ttft_deadline is None else c.ttft_deadline
    return (c.priority, deadline, c.arrival, c.request_id)


def plan_step(running: Sequence[Candidate], waiting: Sequence[Candidate],
              budget: Budget) -> Plan:
    """The next step's work; see the module docstring for the policy."""
    ps, bp = budget.page_size, budget.block_pages

    def grow(held: int, n: int) -> int:
        return (-(-(held + n) // ps) - -(-held // ps)) * bp

    def fits(held: int, want: int, pages: int) -> int:
        """The most of `want` tokens that `pages` pages let a sequence holding `held` add."""
        room = (-(-held // ps) + max(pages, 0) // bp) * ps - held
        return max(0, min(want, room))

    plan = Plan()
    avail = budget.available_pages
    keep = sorted(running, key=_order)
    while True:
        need = sum(grow(c.held, 1) for c in keep if c.pending == 1)
        if need <= avail or not keep:
            break
        victim = keep.pop()
        plan.preempt.append(victim.request_id)
        avail += victim.pin_pages
    decodes = [c for c in keep if c.pending == 1]
    plan.decode = [c.request_id for c in decodes]
    avail -= need
    tokens = budget.max_tokens - len(decodes)

    tpots = [c.tpot_slo for c in decodes if c.tpot_slo is not None]
    if tpots and budget.prefill_token_seconds > 0:
        late = any(c.ttft_deadline is not None and c.ttft_deadline <= budget.now
                   for c in list(keep) + list(waiting) if c.pending > 1)
        if not late:
            spare = min(tpots) - budget.decode_step_seconds
            tokens = min(tokens, max(0, int(spare / budget.prefill_token_seconds)))

    for c in keep:
        if c.pending > 1 and tokens > 0:
            n = fits(c.held, min(c.pending, tokens, budget.chunk), avail)
            if n > 0:
                plan.prefill.append((c.request_id, n))
                avail -= grow(c.held, n)
                tokens -= n

    slots = budget.free_slots + len(plan.preempt)
    for c in sorted(waiting, key=_order):
        if slots <= 0 or tokens <= 0:
            break
        n = min(c.pending, tokens, budget.chunk)
        cost = grow(c.held, n) + c.pin_pages
        if cost > avail:
            break  # head of line waits for pages; later requests do not overtake it
        plan.prefill.append((c.request_id, n))
        plan.admit.append(c.request_id)
        avail -= cost
        tokens -= n
        slots -= 1
    return plan


PROBE_EVERY = 16  # of the store hits restore planning declines, one is restored anyway


def restore_pays(tokens: int, read_bytes: int, write_bytes: int, read_bytes_per_s: float,
                 write_bytes_per_s: float, prefill_token_seconds: float) -> bool:
    """Restore planning: is loading `tokens` tokens of KV (reading `read_bytes` from a store
    tier, writing `write_bytes` into the pool) expected to beat recomputing them? From
    measured rates; True until all three have been measured (loading is the usual winner)."""
    if not (read_bytes_per_s and write_bytes_per_s and prefill_token_seconds):
        return True
    load = read_bytes / read_bytes_per_s + write_bytes / write_bytes_per_s
    return load < tokens * prefill_token_seconds


# ---------------------------------------------------------------------------- the loop


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
    """A request in the scheduler. `on_token(request, token)` sees every new token and
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
    finish_reason: str | None = None  # "stop", "length", "abort", "timeout" or "error"
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    cancelled: bool = False  # set from any thread; the loop aborts it at its next step
    slot: int | None = field(default=None, repr=False)
    num_computed: int = field(default=0, repr=False)
    _computed_before: int = field(default=0, repr=False)
    _key: np.ndarray | None = field(default=None, repr=False)
    _hashes: list[bytes] | None = field(default=None, repr=False)
    _hit: Hit | None = field(default=None, repr=False)  # the store's blocks it would restore
    _declined: bool = field(default=False, repr=False)  # recomputing its hit was planned
    _probe: bool = field(default=False, repr=False)  # restore its hit anyway, to measure
    _rebase: int = field(default=0, repr=False)  # blocks `_hit` gives after re-rotation
    _source_hashes: list[bytes] | None = field(default=None, repr=False)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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


class Scheduler:
    """The serving loop's state. `add` and `abort` may be called from any thread; `step`
    from one thread only."""

    def __init__(self, engine: Engine, config: SchedulerConfig | None = None,
                 store: KVStore | StoreConfig | None = None) -> None:
        self.engine = engine
        self.config = config or SchedulerConfig()
        if isinstance(store, StoreConfig):  # a store for this engine's KV
            store = KVStore(store, model=engine.fingerprint, kv_format=engine.kv_format,
                            page_size=engine.page_size)
        self.store = store
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._incoming: list[Request] = []
        self._decode_s = 0.0
        self._prefill_token_s = 0.0

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
                    r.slot, r.finish_reason = None, reason
        self.waiting, self.running = [], []

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self.waiting) + len(self.running) + len(self._incoming)

    def snapshot(self) -> dict:
        """The serving figures as plain numbers (`LLM.stats()`, `/metrics`)."""
        eng, st = self.engine, self.engine.stats
        with self._lock:
            waiting = len(self.waiting) + len(self._incoming)
        out = {
            "num_requests_running": len(self.running),
            "num_requests_waiting": waiting,
            "kv_pages_used": eng.pages_used,
            "kv_pages_total": eng.total_pages,
            "kv_pages_cached": len(eng.prefix) * eng.block_pages,
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
        }
        if self.store is not None:
            out["store"] = {**self.store.snapshot(), "misses": self.stats.store_misses,
                            "restores_declined": self.stats.restores_declined,
                            "rebased_tokens": self.stats.rebased_tokens}
        return out

    # ------------------------------------------------------------------ one step

    def _candidate(self, r: Request, now: float) -> Candidate:
        eng = self.engine
        ttft = (None if r.ttft_slo_ms is None or r.output
                else r.arrival + r.ttft_slo_ms / 1000)
        tpot = None if r.tpot_slo_ms is None else r.tpot_slo_ms / 1000
        if r.slot is not None:
            return Candidate(r.request_id, r.arrival, len(r.tokens) - r.num_computed,
                             r.num_computed, True, r.priority, eng.pages_freed_by_close(r.slot),
                             ttft, tpot)
        tokens = r.tokens
        if r._hashes is None:
            r._hashes = eng.prompt_hashes(tokens)
        cached, pinned = eng.lookup(r._hashes)
        r._hit, r._rebase = None, 0
        if self.store is not None:
            hit, rebase = self.store.lookup(r._hashes), False
            blocks = 0 if hit is None else hit.blocks
            moved = self._truncated_hit(r)
            if moved is not None and moved[1] > blocks:
                (hit, blocks), rebase = moved, True
            if (hit is not None and blocks * eng.page_size > cached
                    and self.config.restore_planning and not r._probe and not restore_pays(
                        blocks * eng.page_size - cached, hit.entry_bytes, hit.blocks_bytes,
                        self.store.read_bytes_per_s[hit.tier], eng.load_bytes_per_s,
                        self._prefill_token_s)):
                if not r._declined:
                    self.stats.restores_declined += 1
                    r._declined = True
                    # every PROBE_EVERY-th declined hit is loaded anyway, so that rates
                    # measured once (badly, or before the load changed) are measured again
                    r._probe = self.stats.restores_declined % PROBE_EVERY == 0
                if not r._probe:
                    hit = None
            if hit is not None and blocks * eng.page_size > cached:
                # restoring takes new pages for the stored blocks past the device hit
                pinned += eng.pages_for(blocks * eng.page_size) - eng.pages_for(cached)
                cached, r._hit = blocks * eng.page_size, hit
                r._rebase = blocks if rebase else 0
        return Candidate(r.request_id, r.arrival, len(tokens) - cached, cached, False,
                         r.priority, pinned, ttft, tpot)

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
        if r._source_hashes is None:
            r._source_hashes = eng.prompt_hashes(list(t.source))
        hit = self.store.lookup(r._source_hashes)
        if hit is None:
            return None
        ps = eng.page_size
        blocks = min((hit.blocks * ps - t.drop) // ps, (len(r.tokens) - 1) // ps)
        return (hit, blocks) if blocks * ps > t.keep else None

    def _open(self, r: Request) -> int:
        """Give `r` a slot; its held prefix comes from the device prefix cache and, for a
        store hit, from the store (a hit that cannot be loaded is recomputed)."""
        eng, hit = self.engine, r._hit
        restore = None
        if hit is not None:
            try:
                loaded = self.store.load(hit)
                if loaded is not None:
                    restore = SavedPages(hit.blocks, *loaded)
                    if r._rebase:
                        t = r.truncation
                        restore = eng.rebase(restore, r.tokens, t.keep, t.drop)
            except Exception:  # a failed load or move is a miss, never a failed step
                log.exception("could not restore request %s from the store", r.request_id)
                restore = None
            if restore is None:
                self.stats.store_misses += 1
        before = eng.stats.restored_tokens
        try:
            r.slot, cached = eng.open(r.tokens, restore=restore)
        except ValueError:  # the loaded blocks do not fit this prompt: never serve them
            log.exception("restoring request %s from the store failed; recomputing",
                          r.request_id)
            self.stats.store_misses += 1
            r.slot, cached = eng.open(r.tokens)
        if hit is not None:
            restored = eng.stats.restored_tokens - before
            self.stats.restored_tokens[hit.tier] += restored
            if r._rebase:
                self.stats.rebased_tokens += restored
        r._hit, r._rebase = None, 0
        return cached

    def _save(self, r: Request) -> None:
        """Hand `r`'s full blocks to the store's write-behind (never fails the request)."""
        try:
            saved = self.engine.gather(r.slot)
            self.store.save(saved.num_blocks, saved.arrays, saved.hashes, r.session_id)
        except Exception:
            log.exception("could not queue request %s's KV for the store", r.request_id)

    def _finish(self, r: Request, reason: str) -> None:
        if r.slot is not None:
            if self.store is not None and reason != "error":
                self._save(r)
            self.engine.close(r.slot)
            r.slot = None
        r.finish_reason, r.finish_time = reason, time.monotonic()
        self.stats.finished += 1
        if reason in ("abort", "timeout", "error"):
            self.stats.aborted += 1
        if r.on_finish is not None:
            r.on_finish(r)

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
            self.waiting += self._incoming
            self._incoming = []
        for r in self.waiting:
            if r._key is None:
                r._key = self.engine.request_key(r.sampling.seed)
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
        budget = Budget(
            available_pages=eng.available_pages, free_slots=eng.num_free_slots,
            max_tokens=self.config.max_num_batched_tokens or eng.prefill_chunk,
            chunk=eng.prefill_chunk, page_size=eng.page_size, block_pages=eng.block_pages,
            now=now, decode_step_seconds=self._decode_s,
            prefill_token_seconds=self._prefill_token_s)
        waiting = [self._candidate(r, now) for r in self.waiting]
        plan = plan_step([self._candidate(r, now) for r in self.running], waiting, budget)
        if self.store is not None:
            order = [by_id[c.request_id]._hit for c in sorted(waiting, key=_order)]
            self.store.hint([hit.key for hit in order if hit is not None])

        for rid in plan.preempt:
            r = by_id[rid]
            r._computed_before = r.num_computed
            eng.close(r.slot)
            r.slot, r.num_computed, r._hashes = None, 0, None
            r.num_preemptions += 1
            self.stats.preemptions += 1
            self.running.remove(r)
            self.waiting.append(r)
        for rid in plan.admit:
            r = by_id[rid]
            cached = self._open(r)
            r.num_computed = cached
            self.stats.recomputed_tokens += max(0, r._computed_before - cached)
            r._computed_before = 0
            self.waiting.remove(r)
            self.running.append(r)

        prefill, decode = [], []
        for rid, n in plan.prefill:
            r = by_id[rid]
            chunk = r.tokens[r.num_computed: r.num_computed + n]
            prefill.append((r, Row(r.slot, chunk, r.sampling, r._key, len(r.output))))
        for rid in plan.decode:
            r = by_id[rid]
            decode.append((r, Row(r.slot, r.tokens[-1:], r.sampling, r._key, len(r.output))))
        # the plan's page arithmetic is the engine's; should they ever disagree, shed
        # prefill work rather than fail the step
        while prefill and sum(eng.pages_to_grow(row.slot, len(row.tokens))
                              for _, row in prefill + decode) > eng.available_pages:
            log.warning("plan exceeds the pages available; deferring a prefill chunk")
            prefill.pop()
        if not prefill and not decode:
            return finished
        t0 = time.perf_counter()
        out_p, out_d = eng.step([row for _, row in prefill], [row for _, row in decode])
        self._learn(time.perf_counter() - t0, sum(len(row.tokens) for _, row in prefill),
                    bool(decode))
        now = time.monotonic()
        for (r, row), sampled in zip(prefill, out_p, strict=True):
            r.num_computed += len(row.tokens)
            if r.num_computed == len(r.tokens):  # the chunk ended the pending tokens
                self._emit(r, sampled, now)
        for (r, _), sampled in zip(decode, out_d, strict=True):
            r.num_computed += 1
            self._emit(r, sampled, now)
        for r in self.running:
            if r.finished:
                finished.append(r)
        self.running = [r for r in self.running if not r.finished]
        return finished

    def _learn(self, seconds: float, prefill_tokens: int, decoded: bool) -> None:
        """Exponential averages of the step cost model the SLO check uses."""
        if not prefill_tokens:
            self._decode_s = moving_average(self._decode_s, seconds)
        else:
            base = self._decode_s if decoded else 0.0
            per = max(seconds - base, 0.0) / prefill_tokens
            self._prefill_token_s = moving_average(self._prefill_token_s, per)


def generate_all(scheduler: Scheduler, requests: Sequence[Request]) -> None:
    """Run `requests` to completion on this thread (the offline path)."""
    for r in requests:
        scheduler.add(r)
    while scheduler.num_unfinished:
        scheduler.step()


__all__ = ["Budget", "Candidate", "Plan", "Request", "Scheduler", "SchedulerStats",
           "Truncation", "generate_all", "plan_step", "restore_pays"]
