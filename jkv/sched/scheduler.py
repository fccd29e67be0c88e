"""The serving loop around the scheduling policy. `Scheduler` keeps the waiting and running
requests; each `step` runs in three phases:

- schedule: a snapshot of the engine's capacity and the learned costs (`Budget`), each
  waiting request's lookup and restore decision (`plan_restore`), and `plan_step`, pure
  functions of plain numbers described in `jkv.sched.planning` and
  `jkv.sched.restore_planning`; then the plan's moves carried out (slots, preemption,
  layers to and from the host);
- execute: the engine's step over the plan's rows;
- update: each request from its row's output (tokens, finishes, saves, restore checks).

`Request` is what a caller gives and reads; what the scheduler keeps about a request it holds
is its own `Tracked` record (both in `jkv.sched.request`), reset in one place when a run ends.
Lookups, restores (and their checks) and saves go through `jkv.sched.store_side.StoreSide`;
planning's inputs are read by `jkv.sched.plan_inputs`, the plan made rows by `step_rows`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import jax

from jkv.config import SchedulerConfig, StoreConfig
from jkv.engine.engine import Engine
from jkv.engine.records import Sampled
from jkv.sched.output_lengths import OutputLengths
from jkv.sched.plan_inputs import (
    cost_figures,
    request_candidate,
    step_budget,
    with_layers,
    with_tpot_slack,
)
from jkv.sched.plan_records import Budget, Candidate, Plan, queue_order
from jkv.sched.planning import plan_step
from jkv.sched.request import Request, SchedulerStats, Tracked, Truncation
from jkv.sched.restore_planning import RestoreRates
from jkv.sched.snapshot import snapshot
from jkv.sched.step_costs import StepCosts, compilations
from jkv.sched.step_rows import step_rows
from jkv.sched.store_side import StoreSide
from jkv.store.store import KVStore

log = logging.getLogger(__name__)

READ_POLL_S = 0.005  # an idle step waits this long for a read ahead before returning


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
                            aligned_reads=engine.aligned_host_arrays,
                            convert=engine.convert_stored,
                            bf16_ratio=engine.kv_bf16_ratio,
                            backend=jax.default_backend(),
                            whole_rows=engine.connector.stored_whole)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._incoming: list[Request] = []
        self._state: dict[Request, Tracked] = {}  # every request it holds past `add`
        self.costs = StepCosts(engine.runner.decode_rows_bucket)  # learned from each step
        # the figures the last step's plan used, for `snapshot` (other threads read it)
        self.step_costs = {"decode": 0.0, "decode_full": 0.0, "prefill_token": 0.0,
                            "prefill_row": 0.0, "offload_layer": 0.0}
        self._next_step_s = 0.0  # what the next step of the decoding requests will take
        self.lengths = OutputLengths()  # finished replies' lengths: TPOT slack
        # LayerKV's layer-wise offload, where the engine's pages are blocks
        self.layer_offload = self.config.layer_offload
        self.side = StoreSide(engine, self.config, store, self.stats, self.costs, self._state,
                              self.candidate, self.layer_offload)

    @property
    def store(self) -> KVStore | None:
        """The KV store its requests are looked up in and saved to (None: none)."""
        return self.side.store

    @store.setter
    def store(self, store: KVStore | None) -> None:
        self.side.store = store

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

    def serve(self, stop: threading.Event, idle: Callable[[], bool] | None = None) -> None:
        """Step while there is work, else call `idle` until it returns False (a warm-up), then
        sleep; until `stop` is set. A failed step fails the requests in flight."""
        while not stop.is_set():
            with self._wake:
                busy = bool(self._incoming or self.waiting or self.running)
                if not busy and idle is None:
                    self._wake.wait(0.5)
            if not busy:
                idle = idle if idle is not None and idle() else None
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
        return snapshot(self)

    def requests_offloaded(self) -> int:
        """Running requests with layers on the host (read from other threads: a request may
        have just finished, its state gone while the loop still lists it)."""
        return sum(1 for r in list(self.running) if (t := self._state.get(r)) is not None
                   and t.slot is not None and self.engine.offloaded_layers(t.slot))

    # ------------------------------------------------------------------ one step

    def candidate(self, r: Request, held: int, pin_pages: int) -> Candidate:
        """`r` as planning sees it, holding `held` tokens and pinning `pin_pages` pages."""
        return request_candidate(r, held, pin_pages, self._state[r].slot is not None,
                                 self.lengths)

    def _running(self, r: Request, now: float) -> Candidate:
        st, cache = self._state[r], self.engine.cache
        c = self.candidate(r, st.num_computed, cache.pages_freed_by_close(st.slot))
        if self.layer_offload:
            c = with_layers(c, self.engine, st)
        return with_tpot_slack(c, r, now, self.lengths, self._next_step_s)

    def _finish(self, r: Request, reason: str) -> None:
        st = self._state.pop(r, None)  # none yet for a request `stop_all` took from incoming
        if st is not None and st.slot is not None:
            if self.store is not None and reason != "error":
                self.side.save(r, st.slot, st.marks)
            # after a failed step its KV is suspect: nothing of it is kept
            self.engine.close(st.slot, keep=reason != "error")
        r.finish_reason, r.finish_time = reason, time.monotonic()
        self.stats.finished += 1
        if reason in ("abort", "timeout", "error"):
            self.stats.aborted += 1
        else:
            self.stats.count_slo(r)
            self.lengths.add(r.session_id, len(r.output))
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
        """Run one step in three phases: schedule (pure planning over a snapshot of the
        engine's capacity and the learned costs), execute (the engine's step over the rows
        the plan gives), update (each request from its output). Returns the requests that
        finished in it."""
        finished = self._intake()
        if not self.waiting and not self.running:
            return finished
        now = time.monotonic()
        by_id = {r.request_id: r for r in self.waiting + self.running}
        plan, queued, ready = self._schedule(now)
        self._apply(plan, by_id, now)
        prefill, decode, work = step_rows(plan, by_id, self._state, self.engine.cfg.num_layers)
        if not prefill and not decode:
            if queued > ready:  # only reads ahead to wait for: no step to hold up
                self.store.wait_reads(READ_POLL_S)
            return finished
        out_p, out_d = self._execute(prefill, decode, work)
        self._update(prefill, decode, out_p, out_d)
        finished += [r for r in self.running if r.finished]
        self.running = [r for r in self.running if not r.finished]
        return finished

    def _intake(self) -> list[Request]:
        """New requests join the queue; cancelled and timed-out ones end (returned)."""
        with self._lock:
            new, self._incoming = self._incoming, []
            self.waiting += new
        for r in new:
            self._state[r] = Tracked(self.engine.request_key(r.sampling.seed))
        finished: list[Request] = []
        now = time.monotonic()
        for r in self.waiting + self.running:
            if r.cancelled or (r.deadline is not None and now > r.deadline):
                self._finish(r, "abort" if r.cancelled else "timeout")
                finished.append(r)
        self.waiting = [r for r in self.waiting if not r.finished]
        self.running = [r for r in self.running if not r.finished]
        return finished

    def _budget(self, now: float, token_s: float) -> Budget:
        """What this step may use, as the engine's capacity and the learned costs give it
        now (the figures also kept for the stats)."""
        eng = self.engine
        decoding = [self._state[r].slot for r in self.running if r.output]
        self._next_step_s = self.costs.step(
            len(decoding), sum(len(eng.offloaded_layers(s)) for s in decoding))
        if self.store is not None:
            self.store.set_recompute_rate(token_s)
        max_tokens = self.config.max_num_batched_tokens or eng.prefill_chunk
        budget = step_budget(eng, self.costs, max_tokens, self.layer_offload, now, token_s,
                             self._next_step_s)
        self.step_costs = cost_figures(budget)
        return budget

    def _schedule(self, now: float) -> tuple[Plan, int, int]:
        """The step's plan (`plan_step`), each waiting request's restore planned with it and
        recorded, and the store's hints; returns (the plan, requests waiting, those of them
        ready to be admitted: not waiting for a read ahead)."""
        eng = self.engine
        token_s = self.costs.chunked_token_s(eng.prefill_chunk)  # a token fed in full chunks
        budget = self._budget(now, token_s)
        rates = RestoreRates({} if self.store is None else self.store.read_bytes_per_s,
                             eng.connector.load_bytes_per_s, token_s, eng.split_overlap,
                             {} if self.store is None else self.store.convert_bytes_per_s)
        waiting, queued, decisions, cached = [], [], {}, {}
        declined = self.stats.restores_declined
        for r in self.waiting:
            c, decisions[r.request_id], cached[r.request_id], ready = self.side.waiting(
                r, rates, declined, now)
            declined += decisions[r.request_id].newly_declined
            queued.append(c)
            if ready:  # a request still waiting for its read ahead is not admitted yet
                waiting.append(c)
        plan = plan_step([self._running(r, now) for r in self.running], waiting, budget)
        for r in self.waiting:  # the restores planned: what admission loads, the hint, stats
            st, d = self._state[r], decisions[r.request_id]
            st.plan_restore(d, cached[r.request_id])
            if d.newly_declined:
                st.declined = True
                self.stats.restores_declined += 1
        if self.store is not None:
            order = [decisions[c.request_id].hit for c in sorted(queued, key=queue_order)]
            self.store.hint([hit.key for hit in order if hit is not None])
            self.store.drop_reads({hit for hit in order if hit is not None})
        return plan, len(queued), len(waiting)

    def _apply(self, plan: Plan, by_id: dict[str, Request], now: float) -> None:
        """Carry out the plan's moves before the step: admissions held back, layers to the
        host, preemptions, layers back, admissions."""
        eng = self.engine
        for rid in plan.held:
            st = self._state[by_id[rid]]
            self.stats.admissions_held += not st.held
            st.held = True
        for rid, keep in plan.offload.items():  # before preemptions reuse pages
            self.stats.layers_offloaded += eng.keep_resident(self._state[by_id[rid]].slot, keep)
        for rid in plan.preempt:
            self._preempt(by_id[rid])
        for rid in plan.fetch:
            eng.fetch_layers(self._state[by_id[rid]].slot)
            self.stats.layer_fetches += 1
        for rid in plan.admit:
            self._admit(by_id[rid], plan, now)

    def _preempt(self, r: Request) -> None:
        st = self._state[r]
        if self.store is not None:  # what it holds, saved before its pages are reused
            self.side.save(r, st.slot, st.marks)
        self.engine.close(st.slot, finished=False)
        st.preempted()
        r.num_preemptions += 1
        self.stats.preemptions += 1
        self.running.remove(r)
        self.waiting.append(r)

    def _admit(self, r: Request, plan: Plan, now: float) -> None:
        st = self._state[r]
        st.resident = plan.resident.get(r.request_id)
        st.layers_done = 0 if r.request_id in plan.layer_major else None
        self.stats.layer_major_prefills += st.layers_done is not None
        st.num_computed = self.side.open(r)  # (and r.cached_tokens where still unset)
        if r.admit_time is None:
            r.admit_time = now
        self.stats.recomputed_tokens += max(0, st.computed_before - st.num_computed)
        st.computed_before = 0
        self.waiting.remove(r)
        self.running.append(r)

    def _execute(self, prefill: list, decode: list, work: list[int]) -> tuple[list, list]:
        """The engine's step over the rows; its time learned unless it compiled."""
        eng = self.engine
        # (a layer-major prompt brings its layers once for all its tokens: not counted)
        brings = sum(len(eng.offloaded_layers(row.slot)) for _, row in prefill + decode
                     if row.layer_span is None)
        compiled, t0 = compilations(), time.perf_counter()
        out_p, out_d = eng.step([row for _, row in prefill], [row for _, row in decode])
        if compilations() == compiled:  # (a step that compiled is no sample of its cost)
            self.costs.learn(time.perf_counter() - t0, sum(work), len(decode), brings,
                             sum(len(r.tokens) for r, _ in decode), len(prefill))
        return out_p, out_d

    def _update(self, prefill: list, decode: list, out_p: list, out_d: list) -> None:
        """Each request from what its row gave (a failed restore check: nothing,
        `StoreSide.after_step`): tokens computed, the token sampled, logprobs; saves."""
        now = time.monotonic()
        prefill, out_p, decode, out_d = self.side.after_step(prefill, out_p, decode, out_d,
                                                             self.running, self.waiting)
        for (r, row), sampled in zip(prefill, out_p, strict=True):
            st = self._state[r]
            if row.layer_span is not None:
                st.layers_done = None if sampled is not None else row.layer_span[1]
                if sampled is None:
                    continue
            if sampled.positions is not None:
                r.add_prompt_logprobs(st.num_computed, sampled.positions)
            st.num_computed += len(row.tokens)
            if st.num_computed == len(r.tokens):  # the chunk ended the pending tokens
                self._emit(r, sampled, now)
        for (r, _), sampled in zip(decode, out_d, strict=True):
            self._state[r].num_computed += 1
            self._emit(r, sampled, now)
        if self.store is not None and decode:
            self.side.save_decoding([r for r, _ in decode])


def generate_all(scheduler: Scheduler, requests: Sequence[Request]) -> None:
    """Run `requests` to completion on this thread (the offline path)."""
    for r in requests:
        scheduler.add(r)
    while scheduler.num_unfinished:
        scheduler.step()


__all__ = ["Request", "Scheduler", "SchedulerStats", "Truncation", "generate_all"]
