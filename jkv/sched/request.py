"""Requests as the scheduler's callers and the scheduler itself see them.

`Request` is what a caller gives and reads (prompt, sampling, SLOs, callbacks; outputs,
finish reason, timing); `Truncation` says how a prompt was cut from a longer conversation.
What the scheduler keeps about a request it holds (slot, PRNG key, prompt hashes, planned
restore) is its own `Tracked` record, never seen by callers, and `SchedulerStats` are its
counters.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from jkv.engine.sampling import SamplingParams
from jkv.sched.restore_checks import RestoreCheck
from jkv.store.index import Hit


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
    state is kept apart, in `Tracked`). `on_token(request, token)` sees every new token and
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
    # prompt tokens found cached (device prefix cache or store) when first admitted
    cached_tokens: int | None = None
    cached_by_tier: dict[str, int] | None = None  # of which from the device, and each store tier
    cancelled: bool = False  # set from any thread; the loop aborts it at its next step

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add_prompt_logprobs(self, first: int, positions: tuple) -> None:
        """Record what a chunk fed from position `first` gave for the prompt tokens after
        each of its positions."""
        k = self.sampling.prompt_logprobs
        if not self.prompt_logprobs:
            self.prompt_logprobs = [None] * len(self.prompt)
        for i, (lp, ids, lps) in enumerate(zip(*positions, strict=True)):
            p = first + i + 1
            if p < len(self.prompt):
                self.prompt_logprobs[p] = (float(lp), ids[:k].tolist(), lps[:k].tolist())


@dataclass(eq=False)
class Tracked:
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
    # its latest block starts' fingerprints and whether pooled, by position
    # (`restore_checks.record`)
    marks: dict[int, tuple[np.ndarray, bool]] = field(default_factory=dict)
    check: RestoreCheck | None = None  # its restore's check, until its first step gives it

    def plan_restore(self, decision: object, cached: int) -> None:
        """This step's plan for its admission: the store hit it restores (`decision`, a
        `RestoreDecision`) and the tokens found on the device."""
        self.hit, self.rebase, self.probe = decision.hit, decision.rebase, decision.probe
        self.recompute, self.cached = decision.recompute, cached

    def admitted(self) -> None:
        """Its admission's plan carried out."""
        self.hit, self.rebase, self.recompute, self.resident = None, 0, 0.0, None

    def preempted(self) -> None:
        """Its run ended without finishing: what its slot held is gone (recomputed or
        restored when it is admitted again)."""
        self.computed_before = self.num_computed
        self.slot, self.num_computed, self.hashes, self.saved = None, 0, None, 0
        self.read_since, self.abandoned, self.layers_done = None, False, None
        self.marks, self.check = {}, None


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
    # restores checked against their entry's fingerprint (`restore_checks`): passed; failed
    # (discarded, recomputed, the entry quarantined); not checked (no fingerprint to compare)
    restores_verified: int = 0
    verify_failures: int = 0
    restores_unverified: int = 0
    layers_offloaded: int = 0  # running requests' layers moved to the host (LayerKV)
    layer_fetches: int = 0  # running requests whose offloaded layers came back
    admitted_offloaded: int = 0  # requests admitted with some layers on the host
    layer_major_prefills: int = 0  # of those, prompts fed layer-major (`jkv.engine.layer_major`)
    # requests whose admission waited (pages fitting) for a running request's TPOT
    admissions_held: int = 0
    # finished requests that missed their TTFT / TPOT target (counted once each), and those
    # that ended normally meeting every target they had (goodput)
    slo_violations: dict = field(default_factory=lambda: {"ttft": 0, "tpot": 0})
    slo_met: int = 0

    def count_slo(self, r: Request) -> None:
        """A request that ended normally: did it keep its TTFT and TPOT targets?"""
        missed = False
        if r.ttft_slo_ms is not None and r.first_token_time is not None and (
                r.first_token_time - r.arrival > r.ttft_slo_ms / 1000):
            self.slo_violations["ttft"] += 1
            missed = True
        if r.tpot_slo_ms is not None and len(r.output) > 1 and (
                (r.finish_time - r.first_token_time) / (len(r.output) - 1)
                > r.tpot_slo_ms / 1000):
            self.slo_violations["tpot"] += 1
            missed = True
        self.slo_met += not missed
