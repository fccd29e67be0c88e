"""The scheduler's step decisions as pure functions: which requests run in the next step
(`plan_step`); the checks it weighs a choice with (TPOT slack, TTFT, the cost of layers on
the host) are `jkv.sched.plan_checks`, the output-length estimate TPOT slack needs is
`jkv.sched.output_lengths`, whether a waiting request's store hit is restored
`jkv.sched.restore_planning`. They take plain numbers (`Candidate`s, a `Budget`:
`jkv.sched.plan_records`) and return records the scheduler applies, so policies can be
unit-tested and simulated without a model or an engine; nothing here imports the engine or
the store. Page counts come from the KV cache manager's `PageCost` (in the `Budget`), never
from a formula of this module.

Step policy (LayerKV's SLO-aware admission on top of vLLM's FCFS):
- order is (priority, TTFT deadline, arrival): lower priority values go first; with no
  priorities or SLOs that is first come, first served;
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
  (`offload_beats_waiting`; with targets, the slack check below is what weighs them). On the
  H200 at Llama-3-8B's shape a layer brought in costs about what 25 to 45 recomputed tokens
  do, so both mostly say no there; on a CPU recompute is the dearer;
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

from jkv.kv.page_cost import PageCost
from jkv.sched.plan_checks import (
    added_step_seconds,
    admission_keeps_slack,
    admitting_runs_less_late,
    keeps_ttft,
    offload_beats_preempting,
    offload_beats_waiting,
    own_target_overrun,
    steps_until_freed,
)
from jkv.sched.plan_records import Budget, Candidate, Plan, Room, queue_order


def step_pages(cost: PageCost, resident: int | None, held: int, n: int) -> int:
    """Pages a request holding `held` tokens takes to add `n` in a step with `resident`
    layers in the pool (None: all): its resident layers' new pages and, with any layer
    offloaded, one layer's pages of its whole length while that layer runs."""
    if resident is None:
        return cost.grow(held, n)
    return cost.grow(held, n) // cost.layers * resident + cost.layer_pages(held + n)


def step_fits(cost: PageCost, resident: int | None, held: int, want: int, pages: int) -> int:
    """The most of `want` tokens `pages` pages let such a request add in a step."""
    if resident is None:
        return cost.fits(held, want, pages)
    lo, hi = 0, want
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if step_pages(cost, resident, held, mid) <= pages else (lo, mid - 1)
    return lo


def prefill_pages(cost: PageCost, c: Candidate, n: int) -> int:
    """Pages running request `c` takes to feed `n` prompt tokens in a step. Fed layer-major,
    its first step takes its resident layers' pages for the whole prompt and every step one
    layer's pages of it while an offloaded layer runs."""
    if c.layer_major is None:
        return step_pages(cost, c.resident, c.held, n)
    if c.layer_major == 0:
        return step_pages(cost, c.resident, c.held, c.pending)
    return cost.layer_pages(c.held + c.pending)


def prefill_fits(cost: PageCost, c: Candidate, want: int, pages: int) -> int:
    """The most of `want` prompt tokens `pages` pages let running request `c` feed (fed
    layer-major: all of `want` or none, its pages do not depend on them)."""
    if c.layer_major is None:
        return step_fits(cost, c.resident, c.held, want, pages)
    return want if prefill_pages(cost, c, want) <= pages else 0


def min_resident(layers: int, layer_bytes_per_token: float, offload_bytes_per_s: float,
                 prefill_token_seconds: float) -> int:
    """LayerKV eq. 4: the fewest layers a prefill keeps in the pool so that copying the
    others out, (layers - r) x tokens x `layer_bytes_per_token` / bandwidth, hides behind
    computing it, tokens x `prefill_token_seconds` (both linear in the tokens: the prefill's
    quadratic part only leaves more room). 0 until both rates are measured."""
    if not (offload_bytes_per_s and prefill_token_seconds and layer_bytes_per_token):
        return 0
    hidden = int(prefill_token_seconds * offload_bytes_per_s // layer_bytes_per_token)
    return max(0, layers - hidden)


def _decode_pages(cost: PageCost, running: Sequence[Candidate], steps: int) -> int:
    """Pages the decoding requests among `running` take over the next `steps` steps."""
    return sum(step_pages(cost, c.resident, c.held, steps) for c in running if c.pending == 1)


def _offload(plan: Plan, keep: list[Candidate], avail: int, budget: Budget) -> int:
    """LayerKV eq. 5: while the decodes' pages over the next `forecast_steps` steps do not
    fit, the least important running requests keep fewer layers in the pool (as few
    offloaded as cover the gap). Updates `keep` and `plan.offload`; returns `avail`."""
    cost, horizon = budget.cost, max(budget.forecast_steps, 1)
    extra = 0.0  # what the layers moved so far add to each step
    for i in range(len(keep) - 1, -1, -1):
        if _decode_pages(cost, keep, horizon) <= avail:
            break
        c = keep[i]
        r = cost.layers if c.resident is None else c.resident
        if r == 0 or c.offload_pages <= 0:
            continue
        per = c.offload_pages // r  # its own pages in one layer
        for k in range(1, r + 1):
            new = _moved(c, r, k)
            if _decode_pages(cost, keep[:i] + [new] + keep[i + 1:], horizon) <= avail + per * k:
                break
        more = extra + k * budget.offload_layer_seconds
        if not offload_beats_preempting(budget, more, cost.layers - (r - k), c, keep):
            break  # better preempted (and the requests before it are kept whole)
        extra = more
        keep[i] = new
        avail += per * k
        plan.offload[c.request_id] = r - k
    return avail


def _moved(c: Candidate, resident: int, k: int) -> Candidate:
    """Running request `c`, with `resident` layers in the pool, after `k` of them move to
    the host (each its own pages in one layer)."""
    per = c.offload_pages // resident
    return dataclasses.replace(c, resident=resident - k, offload_pages=per * (resident - k),
                               fetch_pages=c.fetch_pages + per * k)


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
        if c.fetch_pages + _decode_pages(cost, after, horizon) <= avail:
            keep[i] = new
            avail -= c.fetch_pages
            plan.fetch.append(c.request_id)
    return avail


def plan_step(running: Sequence[Candidate], waiting: Sequence[Candidate],
              budget: Budget) -> Plan:
    """The next step's work; see the module docstring for the policy."""
    cost = budget.cost
    plan = Plan()
    avail = budget.available_pages
    keep = sorted(running, key=queue_order)
    if budget.layer_offload:
        avail = _offload(plan, keep, avail, budget)
    freed = {c.request_id: c.offload_pages for c in running if c.request_id in plan.offload}
    while True:
        need = _decode_pages(cost, keep, 1)
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
        need = _decode_pages(cost, keep, 1)
    decodes = [c for c in keep if c.pending == 1]
    plan.decode = [c.request_id for c in decodes]
    avail -= need
    tokens = budget.max_tokens - len(decodes)

    # what each decode's target leaves this step: its slack (eq. 1); one already behind
    # (slack below 0: it misses its target anyway) what keeps the step itself within the
    # target, and nothing at all of a prefill that can still meet its TTFT target: a
    # promise already broken does not hold up one that can still be kept (`keeps_ttft`);
    # one whose steps are past its target whatever is admitted holds up none
    spares: dict[bool, list[float]] = {False: [], True: []}  # by that prefill's keepability
    behind = {c.request_id for c in decodes if c.tpot_slack is not None and c.tpot_slack < 0}
    hopeless = {c.request_id for c in decodes if c.request_id in behind
                and c.tpot_slo is not None and budget.decode_step_seconds > c.tpot_slo}
    for c in decodes:
        if c.tpot_slo is not None and c.request_id not in hopeless:
            within = c.tpot_slo - budget.decode_step_seconds
            slack = within if c.tpot_slack is None else c.tpot_slack
            spares[False].append(slack if slack >= 0 else max(slack, within))
            if c.request_id not in behind:
                spares[True].append(spares[False][-1])
    caps, row_tokens, used = {k: tokens for k in spares}, 0, 0  # (prefill tokens so far)
    if spares[False] and budget.prefill_token_seconds > 0:  # eq. 2: within the smallest
        row_tokens = int(budget.prefill_row_seconds / budget.prefill_token_seconds)
        for k, some in spares.items():
            if some:
                caps[k] = min(tokens, max(0, int(min(some) / budget.prefill_token_seconds)))

    def room_for(c: Candidate) -> int:  # prompt tokens `c` may feed (its row's share out)
        return caps[keeps_ttft(c, budget)] - used - row_tokens

    for c in keep:
        if c.pending > 1 and room_for(c) > 0:
            n = prefill_fits(cost, c, min(c.pending, room_for(c), budget.chunk), avail)
            if n > 0:
                plan.prefill.append((c.request_id, n))
                avail -= prefill_pages(cost, c, n)
                used += n + row_tokens
    if keep and not plan.decode and not plan.prefill and tokens > 0:
        # running prefills hold every page and none can take another (no decode will ever
        # finish to free one): the least important give theirs back, recomputed later (not
        # one that frees no page: its prefill would be lost for nothing)
        first = keep[0]
        victims = [c for c in keep[1:] if c.pin_pages > 0]
        while victims:
            victim = victims.pop()
            keep.remove(victim)
            plan.preempt.append(victim.request_id)
            avail += victim.pin_pages
            n = prefill_fits(cost, first, min(first.pending, tokens, budget.chunk), avail)
            if n > 0:
                plan.prefill.append((first.request_id, n))
                avail -= prefill_pages(cost, first, n)
                used += n
                break

    slots = budget.free_slots + len(plan.preempt)
    # the steps to come: the running prefills decode in them too (their rows and their
    # layers on the host), and so does each request admitted below
    rows, later = len(decodes), 0.0
    for c in keep:
        if c.pending > 1:
            later += added_step_seconds(budget, rows, _on_host(cost, c))
            rows += 1
    queue = sorted(waiting, key=queue_order)
    for i, c in enumerate(queue):
        if slots <= 0 or room_for(c) <= 0:
            break
        n = min(c.pending, room_for(c), budget.chunk)
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
        ahead = _forecast(cost, keep, max(budget.forecast_steps, 1)) if layered else 0
        if layered and max(pages, whole) + ahead > avail:
            resident = next((r for r in range(cost.layers - 1, budget.min_resident - 1, -1)
                             if step_pages(cost, r, c.held, span) + c.pin_pages + ahead
                             <= avail), None)
            if resident is None:  # the newest decodes' layers go to the host instead
                resident = budget.min_resident
                room = _room(keep, step_pages(cost, resident, c.held, span) + c.pin_pages
                             + ahead - avail, budget, set(plan.fetch))
            plan.resident[c.request_id] = resident
            pages = step_pages(cost, resident, c.held, span) + c.pin_pages
        if pages > avail + (room.freed if room else 0):
            plan.resident.pop(c.request_id, None)
            break  # head of line waits for pages; later requests do not overtake it
        offloaded = cost.layers - plan.resident.get(c.request_id, cost.layers)
        moved = room.moved if room else 0
        # layers on the host come back once decodes finish (eq. 5's releases): until then
        on_host = (cost.grow(c.held, c.pending) // cost.layers * offloaded
                   + (room.freed if room else 0))
        until = steps_until_freed(on_host, keep)
        bring = (offloaded + moved) * budget.offload_layer_seconds
        extra = later + added_step_seconds(budget, rows, 0)
        keepable = keeps_ttft(c, budget)
        kept = [d for d in decodes if d.request_id not in hopeless
                and not (keepable and d.request_id in behind)]
        own = own_target_overrun(extra, offloaded, c, budget,
                                 None if i + 1 < len(queue) else decodes, until, bring)
        fits = admission_keeps_slack(extra, c, kept, budget, bring, until) and own <= 0
        if not ((fits or (keepable and admitting_runs_less_late(
                    extra, c, kept, budget, bring, until, own)))
                and offload_beats_waiting(budget, offloaded + moved, c, decodes)):
            plan.resident.pop(c.request_id, None)
            plan.held.append(c.request_id)
            break  # it waits (for decodes to finish or gain slack); no one overtakes it
        if room:
            keep[:] = room.running
            avail += room.freed
            plan.offload.update(room.keeps)
        plan.prefill.append((c.request_id, n))
        plan.admit.append(c.request_id)
        if offloaded and span > n:
            plan.layer_major.append(c.request_id)
        avail -= pages
        used += n + row_tokens
        slots -= 1
        rows += 1
        later = extra + bring  # (for those admitted after it, for as long as they decode)
    return plan


def _forecast(cost: PageCost, running: Sequence[Candidate], horizon: int) -> int:
    """The most pages the running requests take beyond their next step at any of the next
    `horizon` steps: their growth (prompts still to feed, then a token a step) less the
    pages of those expected to finish by then."""
    ends = sorted({min(c.remaining or horizon, horizon) for c in running} | {horizon})
    worst = 0
    for t in ends:
        net = 0
        for c in running:
            if (c.remaining or horizon) < t:
                net -= c.pin_pages  # finished: what it holds is free again
            else:
                held = c.held + c.pending - 1
                net += (step_pages(cost, c.resident, held, t)
                        - step_pages(cost, c.resident, held, 1))
        worst = max(worst, net)
    return worst


def _room(keep: list[Candidate], need: int, budget: Budget, fetched: set[str]
          ) -> Room | None:
    """LayerKV eq. 5 for an admission: the decoding requests' resident layers that move to
    the host, the newest first (not those fetched this step), to free `need` pages beyond
    what their next step takes. Returns the running requests after, the pages freed, the
    layers moved and each moved request's layers kept; None where moving all would not do."""
    cost, keep, freed, moved, keeps = budget.cost, list(keep), 0, 0, {}
    for i in range(len(keep) - 1, -1, -1):
        c = keep[i]
        r = cost.layers if c.resident is None else c.resident
        if c.pending != 1 or r == 0 or c.offload_pages <= 0 or c.request_id in fetched:
            continue
        per, before = c.offload_pages // r, _decode_pages(cost, keep, 1)
        for k in range(1, r + 1):
            trial = keep[:i] + [_moved(c, r, k)] + keep[i + 1:]
            gain = per * k - (_decode_pages(cost, trial, 1) - before)
            if freed + gain >= need:
                break
        if gain <= 0:
            continue
        keep, freed, moved = trial, freed + gain, moved + k
        keeps[c.request_id] = r - k
        if freed >= need:
            return Room(keep, freed, moved, keeps)
    return None


def _on_host(cost: PageCost, c: Candidate) -> int:
    return 0 if c.resident is None else cost.layers - c.resident


__all__ = ["min_resident", "plan_step", "prefill_fits", "prefill_pages", "step_fits",
           "step_pages", "steps_until_freed"]
