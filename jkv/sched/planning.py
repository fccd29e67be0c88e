"""The scheduler's step decisions as pure functions: which requests run in the next step
(`plan_step`); the checks it weighs a choice with (TPOT slack, TTFT, the cost of layers on
the host) are LayerKV's, `jkv.policies.layerkv`, the output-length estimate TPOT slack needs is
`jkv.sched.output_lengths`, whether a waiting request's store hit is restored
`jkv.sched.restore_planning`. They take plain numbers (`Candidate`s, a `Budget`:
`jkv.sched.plan_records`) and return records the scheduler applies, so policies can be
unit-tested and simulated without a model or an engine; nothing here imports the engine or
the store. Page counts come from the KV cache manager's `PageCost` (in the `Budget`), never
from a formula of this module.

Step policy (LayerKV's SLO-aware admission on top of vLLM's FCFS):
- order is (priority, deadline, arrival): lower priority values go first; the deadline is
  a request's TTFT deadline, or for one preempted part way through its reply, when its next
  token is due on its TPOT schedule (`queue_order`); with no priorities or SLOs that is
  first come, first served;
- running decodes always get their token; when their pages do not fit, the least important
  running request (the newest, among equals; not one that would free no page) is preempted:
  its pages are released (its full blocks stay in the prefix cache when that is on) and it
  is recomputed later; so are the least important running prefills (again only those that
  free a page) when, with no decode running, none of them can get a page;
- with layer-wise offload (LayerKV), before anyone is preempted: while the decodes' pages over
  the next `forecast_steps` steps do not fit (eq. 5), the least important running requests
  move as few resident layers to the host as cover the gap (a request with offloaded layers
  goes on running, each such layer brought through the pool for its turn); a running
  request's offloaded layers come back, most important first, while the forecast still fits
  after; a new request whose chunk does not fit with every layer is admitted with as many
  resident layers as fit, at least `min_resident` (eq. 4), the decodes' pages over the
  forecast's steps kept free; one that does not fit even at `min_resident` makes room: the
  newest decodes move resident layers to the host, as few as free its pages (eq. 5: room
  made by offloading instead of a queue that waits for a finish); a prompt longer than a chunk
  admitted so is fed layer-major (`jkv.engine.layer_major`: its resident layers' pages for the
  whole prompt must fit then, its chunk of tokens buys a share of its layers each step),
  and so is one whose first chunk fits with every layer but whole prompt does not (chunk
  by chunk it would stall part way, its later chunks waiting for pages);
- layers on the host are weighed against the alternative, from measured costs: a running
  request gives layers up only where bringing them in each step of its remaining output
  costs the step less than recomputing what it holds (`offload_beats_recompute`; else it is
  preempted, and comes back only with every layer: back at once with layers on the host it
  would pay both, and be preempted again as the decodes grow); one with a TPOT target counts
  its wait for pages and its recompute too, and keeps its layers on the host where that
  runs the decodes less far past their targets than preempting it would run it
  (`offload_beats_preempting`: late by the time past each one's slack); where no decode
  carries a TPOT target a new request is admitted with layers on the host only where they
  cost the decoding requests' steps less than its wait for the first of them to finish
  (`offload_beats_waiting`; with targets, the slack check below is what weighs them). On a
  GPU a layer brought in can cost more than recomputing a short request's tokens, so both
  mostly say no there; on a CPU recompute is the dearer;
- a new request whose pages fit is held while the steps it would decode in, each longer by
  its row (a step of one more decode, as measured or fitted), its layers on the host and
  those moved to make room for it (each the measured seconds of bringing one in, until the
  decodes expected to finish first free the pages that take them back), and the
  rows and layers of the running prefills and of those admitted before it (they decode in
  those steps too), would take a decoding request past its TPOT target
  (`admission_keeps_slack`, LayerKV eq. 1 over the steps to come), or, with layers on the
  host, its own steps past its own (`own_target_overrun`; with no one queued behind it, its
  mean: its steps as long as those while the decodes it joins run, its own row's after);
- prefill tokens share a per-step budget with the decodes; partly prefilled requests continue
  before new ones are admitted; a new request is admitted only while a slot is free and its
  first chunk's pages fit;
- while running decodes carry a TPOT target, prefill tokens per step are capped so that the
  prefill time fits the smallest spare among them (LayerKV eq. 1-2: a request's slack, what
  its target allows over its whole output, (generated - 1 + remaining) x target, less the
  time it has spent since its first token and the remaining tokens' decode steps; for a
  request already behind, whose slack is below 0, its target less one decode step: each
  step within its target, its mean no worse, while prefills still move). A waiting request
  past its TTFT deadline lifts neither this cap nor the admission check: the promises made to
  running requests come first (when it did, under load every step carried a whole chunk and
  TPOT targets broke as well); but a decode already behind holds back no prefill that can
  still meet its TTFT target (`keeps_ttft`): a broken promise does not break a keepable one;
  and one whose every step is past its target already (a decode step alone takes longer)
  holds back no prefill at all: holding one keeps no promise, only adds the waiting one's
  lateness to theirs. An admission that would break a decode's slack still goes in while it
  can meet its TTFT target and holding it (until the first decode finishes) would run it
  further past that target than admitting runs the decodes past theirs and itself past its
  own TPOT target (`admitting_runs_less_late`): promises weighed by how far each is broken.
  The step costs come from `jkv.sched.step_costs.StepCosts`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jkv.policies.layerkv import (
    added_step_seconds,
    admission_keeps_slack,
    admitting_runs_less_late,
    keeps_ttft,
    offload_beats_preempting,
    offload_beats_waiting,
    own_target_overrun,
    steps_until_freed,
)
from jkv.sched.plan_pages import (
    decode_pages,
    forecast,
    layers_on_host,
    min_resident,
    moved_layers,
    prefill_fits,
    prefill_pages,
    room_for_admission,
    step_fits,
    step_pages,
)
from jkv.sched.plan_records import Budget, Candidate, Plan, Room, queue_order


def _offload(plan: Plan, keep: list[Candidate], avail: int, budget: Budget) -> int:
    """LayerKV eq. 5: while the decodes' pages over the next `forecast_steps` steps do not
    fit, the least important running requests keep fewer layers in the pool (as few
    offloaded as cover the gap). Updates `keep` and `plan.offload`; returns `avail`."""
    cost, horizon = budget.cost, max(budget.forecast_steps, 1)
    extra = 0.0  # what the layers moved so far add to each step
    for i in range(len(keep) - 1, -1, -1):
        if decode_pages(cost, keep, horizon) <= avail:
            break
        c = keep[i]
        r = cost.layers if c.resident is None else c.resident
        if r == 0 or c.offload_pages <= 0:
            continue
        per = c.offload_pages // r  # its own pages in one layer
        for k in range(1, r + 1):
            new = moved_layers(c, r, k)
            if decode_pages(cost, keep[:i] + [new] + keep[i + 1:], horizon) <= avail + per * k:
                break
        more = extra + k * budget.offload_layer_seconds
        if not offload_beats_preempting(budget, more, cost.layers - (r - k), c, keep):
            break  # better preempted (and the requests before it are kept whole)
        extra = more
        keep[i] = new
        avail += per * k
        plan.offload[c.request_id] = r - k
    return avail


def _fetch(plan: Plan, keep: list[Candidate], avail: int, budget: Budget) -> int:
    """Running requests with offloaded layers get them back, most important first, while
    the decodes' pages over the forecast still fit after. Returns `avail`."""
    cost, horizon = budget.cost, max(budget.forecast_steps, 1)
    for i, c in enumerate(keep):
        if c.fetch_pages <= 0 or c.request_id in plan.offload:
            continue
        new = dataclasses.replace(c, resident=None, offload_pages=c.offload_pages
                                  + c.fetch_pages, fetch_pages=0)
        after = keep[:i] + [new] + keep[i + 1:]
        if c.fetch_pages + decode_pages(cost, after, horizon) <= avail:
            keep[i] = new
            avail -= c.fetch_pages
            plan.fetch.append(c.request_id)
    return avail


@dataclasses.dataclass
class _Step:
    """What `plan_step`'s parts share while they fill the plan."""

    plan: Plan
    keep: list[Candidate]  # the running requests kept, most important first
    avail: int  # pages still free for this step
    decodes: list[Candidate] = dataclasses.field(default_factory=list)
    tokens: int = 0  # prompt tokens the step may take besides its decodes
    # the prompt tokens the decodes' slack leaves, for a prefill that can still meet its
    # TTFT target (True) or not (False); each prefill row's share of a step in tokens
    caps: dict[bool, int] = dataclasses.field(default_factory=dict)
    row_tokens: int = 0
    used: int = 0  # prompt tokens (and rows' shares) planned so far
    behind: set[str] = dataclasses.field(default_factory=set)  # decodes past their target
    hopeless: set[str] = dataclasses.field(default_factory=set)  # past it whatever is done

    def room_for(self, c: Candidate, budget: Budget) -> int:
        """Prompt tokens `c` may feed (its row's share out)."""
        return self.caps[keeps_ttft(c, budget)] - self.used - self.row_tokens


def plan_step(running: Sequence[Candidate], waiting: Sequence[Candidate],
              budget: Budget) -> Plan:
    """The next step's work; see the module docstring for the policy."""
    s = _plan_decodes(running, budget)
    _slack_caps(s, budget)
    _plan_running_prefills(s, budget)
    _plan_admissions(s, waiting, budget)
    return s.plan


def _plan_decodes(running: Sequence[Candidate], budget: Budget) -> _Step:
    """Every running decode gets its token: layers to the host (LayerKV) or preemptions of
    the least important while their pages do not fit, layers back while they do."""
    cost, plan, avail = budget.cost, Plan(), budget.available_pages
    keep = sorted(running, key=queue_order)
    if budget.layer_offload:
        avail = _offload(plan, keep, avail, budget)
    freed = {c.request_id: c.offload_pages for c in running if c.request_id in plan.offload}
    while True:
        need = decode_pages(cost, keep, 1)
        if need <= avail or not keep:
            break
        victim = keep.pop(next((i for i in range(len(keep) - 1, 0, -1)
                                if keep[i].pin_pages > 0), 0))  # (none that frees nothing)
        plan.preempt.append(victim.request_id)
        if plan.offload.pop(victim.request_id, None) is not None:  # not offloaded after all
            avail -= freed[victim.request_id] - victim.offload_pages
        avail += victim.pin_pages
    if budget.layer_offload and not plan.preempt:  # (no pages freed by a preemption)
        avail = _fetch(plan, keep, avail, budget)
        need = decode_pages(cost, keep, 1)
    decodes = [c for c in keep if c.pending == 1]
    plan.decode = [c.request_id for c in decodes]
    return _Step(plan, keep, avail - need, decodes, budget.max_tokens - len(decodes))


def _slack_caps(s: _Step, budget: Budget) -> None:
    """What each decode's target leaves this step: its slack (eq. 1); one already behind
    (slack below 0: it misses its target anyway) what keeps the step itself within the
    target, and nothing at all of a prefill that can still meet its TTFT target: a promise
    already broken does not hold up one that can still be kept (`keeps_ttft`); one whose
    steps are past its target whatever is admitted holds up none."""
    spares: dict[bool, list[float]] = {False: [], True: []}  # by that prefill's keepability
    s.behind = {c.request_id for c in s.decodes
                if c.tpot_slack is not None and c.tpot_slack < 0}
    s.hopeless = {c.request_id for c in s.decodes if c.request_id in s.behind
                  and c.tpot_slo is not None and budget.decode_step_seconds > c.tpot_slo}
    for c in s.decodes:
        if c.tpot_slo is not None and c.request_id not in s.hopeless:
            within = c.tpot_slo - budget.decode_step_seconds
            slack = within if c.tpot_slack is None else c.tpot_slack
            spares[False].append(slack if slack >= 0 else max(slack, within))
            if c.request_id not in s.behind:
                spares[True].append(spares[False][-1])
    s.caps = {k: s.tokens for k in spares}
    if spares[False] and budget.prefill_token_seconds > 0:  # eq. 2: within the smallest
        s.row_tokens = int(budget.prefill_row_seconds / budget.prefill_token_seconds)
        for k, some in spares.items():
            if some:
                s.caps[k] = min(s.tokens,
                                max(0, int(min(some) / budget.prefill_token_seconds)))


def _plan_running_prefills(s: _Step, budget: Budget) -> None:
    """Running prefills feed their next chunks as pages and the caps allow. Where they hold
    every page and none can take another (no decode will ever finish to free one), the
    least important give theirs back, recomputed later (not one that frees no page: its
    prefill would be lost for nothing)."""
    cost, plan = budget.cost, s.plan
    for c in s.keep:
        if c.pending > 1 and s.room_for(c, budget) > 0:
            n = prefill_fits(cost, c, min(c.pending, s.room_for(c, budget), budget.chunk),
                             s.avail)
            if n > 0:
                plan.prefill.append((c.request_id, n))
                s.avail -= prefill_pages(cost, c, n)
                s.used += n + s.row_tokens
    if not (s.keep and not plan.decode and not plan.prefill and s.tokens > 0):
        return
    first = s.keep[0]
    victims = [c for c in s.keep[1:] if c.pin_pages > 0]
    while victims:
        victim = victims.pop()
        s.keep.remove(victim)
        plan.preempt.append(victim.request_id)
        s.avail += victim.pin_pages
        n = prefill_fits(cost, first, min(first.pending, s.tokens, budget.chunk), s.avail)
        if n > 0:
            plan.prefill.append((first.request_id, n))
            s.avail -= prefill_pages(cost, first, n)
            s.used += n
            break


def _plan_admissions(s: _Step, waiting: Sequence[Candidate], budget: Budget) -> None:
    """Waiting requests admitted in queue order while pages, slots and the targets allow;
    the first that cannot be admitted holds up those behind it."""
    cost, plan = budget.cost, s.plan
    slots = budget.free_slots + len(plan.preempt)
    # the steps to come: the running prefills decode in them too (their rows and their
    # layers on the host), and so does each request admitted below
    rows, later = len(s.decodes), 0.0
    for c in s.keep:
        if c.pending > 1:
            later += added_step_seconds(budget, rows, layers_on_host(cost, c))
            rows += 1
    queue = sorted(waiting, key=queue_order)
    for i, c in enumerate(queue):
        if slots <= 0 or s.room_for(c, budget) <= 0:
            break
        n = min(c.pending, s.room_for(c, budget), budget.chunk)
        fit = _admission_pages(s, c, n, budget)
        if fit is None:
            break  # head of line waits for pages; later requests do not overtake it
        pages, span, room = fit
        offloaded = cost.layers - plan.resident.get(c.request_id, cost.layers)
        moved = room.moved if room else 0
        # layers on the host come back once decodes finish (eq. 5's releases): until then
        on_host = (cost.grow(c.held, c.pending) // cost.layers * offloaded
                   + (room.freed if room else 0))
        until = steps_until_freed(on_host, s.keep)
        bring = (offloaded + moved) * budget.offload_layer_seconds
        extra = later + added_step_seconds(budget, rows, 0)
        if not _admission_keeps_targets(s, c, budget, extra, offloaded, moved, until, bring,
                                         last=i + 1 == len(queue)):
            plan.resident.pop(c.request_id, None)
            plan.held.append(c.request_id)
            break  # it waits (for decodes to finish or gain slack); no one overtakes it
        if room:
            s.keep[:] = room.running
            s.avail += room.freed
            plan.offload.update(room.keeps)
        plan.prefill.append((c.request_id, n))
        plan.admit.append(c.request_id)
        if offloaded and span > n:
            plan.layer_major.append(c.request_id)
        s.avail -= pages
        s.used += n + s.row_tokens
        slots -= 1
        rows += 1
        later = extra + bring  # (for those admitted after it, for as long as they decode)


def _admission_pages(s: _Step, c: Candidate, n: int, budget: Budget
                     ) -> tuple[int, int, Room | None] | None:
    """The pages admitting `c` with `n` prompt tokens takes, the tokens its resident
    layers take pages for, and the decodes' layers moved to the host to make room (with
    layer offload: as many of its layers resident as fit, `plan.resident`); None when
    they cannot be had."""
    cost, plan = budget.cost, s.plan
    pages = cost.grow(c.held, n) + c.pin_pages
    # with layers on the host, a prompt longer than a chunk is fed layer-major: its
    # resident layers take the whole prompt's pages at once
    long = c.layer_major is not None and c.pending > budget.chunk
    span = c.pending if long else n
    # LayerKV: as many layers as fit, for the whole prompt where it is fed layer-major
    # (one whose first chunk fits but not the rest would stall part way, its later
    # chunks waiting for pages the decodes take)
    whole = cost.grow(c.held, c.pending) + c.pin_pages if long else pages
    room = None  # running requests' layers moved to the host to make room for it
    # LayerKV eq. 5: what the running requests grow by over the forecast's steps, less
    # what those expected to finish by then free, stays free too
    layered = budget.layer_offload and not c.whole
    ahead = forecast(cost, s.keep, max(budget.forecast_steps, 1)) if layered else 0
    if layered and max(pages, whole) + ahead > s.avail:
        resident = next((r for r in range(cost.layers - 1, budget.min_resident - 1, -1)
                         if step_pages(cost, r, c.held, span) + c.pin_pages + ahead
                         <= s.avail), None)
        if resident is None:  # the newest decodes' layers go to the host instead
            resident = budget.min_resident
            room = room_for_admission(s.keep, step_pages(cost, resident, c.held, span) + c.pin_pages
                         + ahead - s.avail, budget, set(plan.fetch))
        plan.resident[c.request_id] = resident
        pages = step_pages(cost, resident, c.held, span) + c.pin_pages
    if pages > s.avail + (room.freed if room else 0):
        plan.resident.pop(c.request_id, None)
        return None
    return pages, span, room


def _admission_keeps_targets(s: _Step, c: Candidate, budget: Budget, extra: float,
                             offloaded: int, moved: int, until: int | None, bring: float,
                             last: bool) -> bool:
    """Whether admitting `c` (its steps `extra` seconds longer; `offloaded` of its layers
    and `moved` of the decodes' on the host until `until` steps, `bring` seconds a step to
    bring them; `last` in the queue) keeps the decodes' slack and its own target, or runs
    less late than holding it would, and beats waiting."""
    keepable = keeps_ttft(c, budget)
    kept = [d for d in s.decodes if d.request_id not in s.hopeless
            and not (keepable and d.request_id in s.behind)]
    own = own_target_overrun(extra, offloaded, c, budget, s.decodes if last else None,
                             until, bring)
    fits = admission_keeps_slack(extra, c, kept, budget, bring, until) and own <= 0
    return ((fits or (keepable and admitting_runs_less_late(
                extra, c, kept, budget, bring, until, own)))
            and offload_beats_waiting(budget, offloaded + moved, c, s.decodes))



__all__ = ["min_resident", "plan_step", "prefill_fits", "prefill_pages", "step_fits",
           "step_pages", "steps_until_freed"]
