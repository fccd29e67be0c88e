"""The scheduler's decisions as pure functions: which requests run in the next step
(`plan_step`) and whether a waiting request's store hit is restored or recomputed
(`plan_restore`), and the output-length estimate TPOT slack needs (`OutputLengths`). They take
plain numbers (`Candidate`s, a `Budget`, `RestoreRates`) and return
records the scheduler applies, so policies can be unit-tested and simulated without a model or
an engine; nothing here imports the engine or the store at run time. Page counts come from the
KV cache manager's `PageCost` (in the `Budget`), never from a formula of this module.

Step policy (LayerKV's SLO-aware admission on top of vLLM's FCFS):
- order is (priority, TTFT deadline, arrival): lower priority values go first; with no
  priorities or SLOs that is first come, first served;
- running decodes always get their token; when their pages do not fit, the least important
  running request (the newest, among equals) is preempted: its pages are released (its full
  blocks stay in the prefix cache when that is on) and it is recomputed later; so are the
  least important running prefills when, with no decode running, none of them can get a page;
- prefill tokens share a per-step budget with the decodes; partly prefilled requests continue
  before new ones are admitted; a new request is admitted only while a slot is free and its
  first chunk's pages fit;
- while running decodes carry a TPOT target, prefill tokens per step are capped so that the
  prefill time fits the smallest slack among them (LayerKV eq. 1-2: what a request's target
  allows over its whole output, (generated - 1 + remaining) x target, less the time it has
  spent since its first token and the remaining tokens' decode steps; with no slack known,
  the target less one decode step), unless a waiting request is already past its TTFT
  deadline (then both promises are broken and the oldest one wins).

Restore policy: a store hit past the device prefix cache's hit is restored only while loading
it is expected to beat recomputing it (`restore_pays`, from measured rates); every
`PROBE_EVERY`-th declined hit is restored anyway, so that rates measured once (badly, or
before the load changed) are measured again. A restored hit may be split (Krul 6.1, eq. 1):
a share r_c of it recomputed while the rest loads, r_c balancing the two (`split_share`);
full load (0) and full recompute (declining the hit) are its two ends.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from jkv.cache.page_cost import PageCost

if TYPE_CHECKING:
    from jkv.store.store import Hit

# ---------------------------------------------------------------------------- the step


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
    # a decoding request's TPOT slack: seconds of prefill a step may add now and still keep
    # its whole output within tpot_slo (LayerKV eq. 1); None: not known, tpot_slo per step
    tpot_slack: float | None = None


@dataclass(frozen=True)
class Budget:
    """What one step may use, and the cost model the TPOT cap estimates step time with."""

    available_pages: int  # free pages plus unreferenced cached blocks and kept tiered rows
    free_slots: int
    max_tokens: int  # tokens per step, decode and prefill together
    chunk: int  # most tokens one request feeds in one step
    cost: PageCost  # the KV cache manager's: pages that tokens take
    now: float = 0.0
    decode_step_seconds: float = 0.0  # cost model: a step of decodes alone
    prefill_token_seconds: float = 0.0  # cost model: each prefill token on top


@dataclass
class Plan:
    """The next step's work by request id; the scheduler turns it into an engine step."""

    preempt: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    prefill: list[tuple[str, int]] = field(default_factory=list)  # (request, tokens to feed)
    admit: list[str] = field(default_factory=list)  # waiting requests among `prefill`


def queue_order(c: Candidate) -> tuple:
    """Sort key of the queue (most important first); the store's hint follows it too."""
    deadline = math.inf if c.ttft_deadline is None else c.ttft_deadline
    return (c.priority, deadline, c.arrival, c.request_id)


def plan_step(running: Sequence[Candidate], waiting: Sequence[Candidate],
              budget: Budget) -> Plan:
    """The next step's work; see the module docstring for the policy."""
    grow, fits = budget.cost.grow, budget.cost.fits
    plan = Plan()
    avail = budget.available_pages
    keep = sorted(running, key=queue_order)
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

    spares = [c.tpot_slo - budget.decode_step_seconds if c.tpot_slack is None
              else c.tpot_slack for c in decodes if c.tpot_slo is not None]
    if spares and budget.prefill_token_seconds > 0:
        late = any(c.ttft_deadline is not None and c.ttft_deadline <= budget.now
                   for c in list(keep) + list(waiting) if c.pending > 1)
        if not late:  # eq. 2: the step's prefill time within the smallest slack
            tokens = min(tokens, max(0, int(min(spares) / budget.prefill_token_seconds)))

    for c in keep:
        if c.pending > 1 and tokens > 0:
            n = fits(c.held, min(c.pending, tokens, budget.chunk), avail)
            if n > 0:
                plan.prefill.append((c.request_id, n))
                avail -= grow(c.held, n)
                tokens -= n
    if keep and not plan.decode and not plan.prefill and tokens > 0:
        # running prefills hold every page and none can take another (no decode will ever
        # finish to free one): the least important give theirs back, recomputed later
        first = keep[0]
        while len(keep) > 1:
            victim = keep.pop()
            plan.preempt.append(victim.request_id)
            avail += victim.pin_pages
            n = fits(first.held, min(first.pending, tokens, budget.chunk), avail)
            if n > 0:
                plan.prefill.append((first.request_id, n))
                avail -= grow(first.held, n)
                tokens -= n
                break

    slots = budget.free_slots + len(plan.preempt)
    for c in sorted(waiting, key=queue_order):
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


class OutputLengths:
    """How long a reply will be, for TPOT slack (LayerKV 3.1): the lengths of finished
    replies, per session and of the last `window` overall. An estimate is conservative (a
    low quantile: a short future leaves less slack), never above the request's max_tokens."""

    def __init__(self, quantile: float = 0.25, window: int = 256) -> None:
        self.quantile = quantile
        self.recent: collections.deque[int] = collections.deque(maxlen=window)
        self.sessions: dict[str, collections.deque[int]] = {}

    def add(self, session: str | None, length: int) -> None:
        self.recent.append(length)
        if session is not None:
            self.sessions.setdefault(session, collections.deque(maxlen=16)).append(length)

    def remaining(self, session: str | None, max_tokens: int, generated: int) -> int:
        """Tokens a request that has generated `generated` is expected to generate still
        (at least 1): from its session's replies, else recent ones, else just the next."""
        seen = (self.sessions.get(session) if session is not None else None) or self.recent
        total = int(np.quantile(list(seen), self.quantile)) if seen else 0
        return max(1, min(total, max_tokens) - generated)


# ---------------------------------------------------------------------------- restores

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


def split_share(recompute_s: float, write_s: float, read_s: float,
                overlap: float) -> float:
    """Krul's recompute ratio r_c (eq. 1: min |T_C - T_L|) for a hit that recomputes in
    `recompute_s` seconds, or is read in `read_s` (whole, before anything) and written into
    the pool in `write_s`: r_c = T_W / (T_C + T_W) when that beats both ends, else 0.
    `overlap` in [0, 1]: how much of the shorter of the two parts the device hides behind the
    longer (1: fully, separate copy and compute engines; 0: one after the other, when a split
    only interpolates)."""
    if recompute_s <= 0 or write_s <= 0:
        return 0.0
    share = write_s / (recompute_s + write_s)
    both = share * recompute_s  # = (1 - share) * write_s: the two parts' common length
    if read_s + (2.0 - overlap) * both < min(recompute_s, read_s + write_s):
        return share
    return 0.0


@dataclass(frozen=True)
class RestoreRates:
    """The measured rates restore planning weighs; 0.0 means not measured yet."""

    read_bytes_per_s: Mapping[str, float]  # reading an entry, per store tier ("host", "disk")
    write_bytes_per_s: float  # host arrays into the pool (`Engine.load_bytes_per_s`)
    prefill_token_seconds: float  # computing one prompt token
    split_overlap: float = 0.0  # `split_share`'s overlap (`Engine.split_overlap`)


@dataclass(frozen=True)
class RestoreDecision:
    """Restore planning's answer for one waiting request; the scheduler applies it after the
    step is planned (and counts `newly_declined`)."""

    held: int  # tokens it would hold on admission: the device hit's, or the restored blocks'
    hit: Hit | None = None  # the store entry to restore on admission; None: none
    extra_pages: int = 0  # pages restoring takes past those of the device hit
    rebase: int = 0  # blocks `hit` gives once re-rotated (a truncated prompt); 0: in place
    newly_declined: bool = False  # recomputing the hit was planned for the first time
    probe: bool = False  # the request's probe flag from now on: restore anyway, to measure
    recompute: float = 0.0  # share of the restored blocks recomputed meanwhile (a split)

    @property
    def restore(self) -> bool:
        return self.hit is not None


def plan_restore(cached: int, hit: Hit | None, moved: tuple[Hit, int] | None,
                 rates: RestoreRates, *, cost: PageCost,
                 planning: bool = True, declined: bool = False, probe: bool = False,
                 declined_count: int = 0) -> RestoreDecision:
    """Whether a waiting request restores a store hit, as a pure function so it can be
    tested and the scheduler can count its statistics after planning.

    `cached`: tokens the device prefix cache holds of its prompt; `hit`: the store's run of
    its blocks; `moved`: for a truncated prompt, its source's entry and the prompt blocks it
    gives once re-rotated (used when it gives more than `hit`). `planning=False` restores
    every hit that adds blocks. `declined`/`probe`: the request's earlier decisions (a
    decline is counted once; a probe restores without weighing rates); `declined_count`:
    declines counted so far, which picks every `PROBE_EVERY`-th one as a probe."""
    blocks, rebase = (0 if hit is None else hit.blocks), False
    if moved is not None and moved[1] > blocks:
        (hit, blocks), rebase = moved, True
    tokens = blocks * cost.page_size
    newly = False
    if (hit is not None and tokens > cached and planning and not probe and not restore_pays(
            tokens - cached, hit.entry_bytes, hit.blocks_bytes,
            rates.read_bytes_per_s[hit.tier], rates.write_bytes_per_s,
            rates.prefill_token_seconds)):
        if not declined:
            newly = True
            probe = (declined_count + 1) % PROBE_EVERY == 0
        if not probe:
            hit = None
    if hit is None or tokens <= cached:
        return RestoreDecision(cached, newly_declined=newly, probe=probe)
    share = 0.0
    read_rate = rates.read_bytes_per_s.get(hit.tier, 0.0)
    if planning and not probe and read_rate and rates.write_bytes_per_s:
        share = split_share((tokens - cached) * rates.prefill_token_seconds,
                            hit.blocks_bytes * (tokens - cached) / tokens
                            / rates.write_bytes_per_s,
                            hit.entry_bytes / read_rate, rates.split_overlap)
    # restoring takes new pages for the stored blocks past the device hit
    return RestoreDecision(tokens, hit, cost.grow(cached, tokens - cached),
                           blocks if rebase else 0, newly, probe, share)


__all__ = ["PROBE_EVERY", "Budget", "Candidate", "OutputLengths", "Plan", "RestoreDecision",
           "RestoreRates", "plan_restore", "plan_step", "queue_order", "restore_pays",
           "split_share"]
