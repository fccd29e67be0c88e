"""LayerKV's admission (LayerKV, section 3.1): the SLO-aware checks a step's choice is
weighed with, from measured costs and the requests' targets: whether the steps an admission
adds keep every decoding request within its TPOT target (eq. 1, the TPOT slack, over the
steps to come) and its own, whether a prefill can still meet its TTFT target, and whether
layers on the host cost less than preempting the request or its wait for pages.
`jkv.sched.planning` applies these decisions; they are pure functions over the few fields
of its `Budget` and `Candidate` named below (`Costs`, `Decoding`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Costs(Protocol):
    """The step's cost model these checks read (`jkv.sched.plan_records.Budget`'s)."""

    now: float
    prefill_token_seconds: float
    decode_step_seconds: float
    decode_step_by_rows: tuple[float, ...]
    offload_layer_seconds: float
    lossy_recompute: bool


class Decoding(Protocol):
    """A request as these checks read it (`jkv.sched.plan_records.Candidate`'s fields)."""

    pending: int
    held: int
    pin_pages: int
    remaining: int | None
    tpot_slo: float | None
    tpot_slack: float | None
    ttft_deadline: float | None


def keeps_ttft(c: Decoding, budget: Costs) -> bool:
    """Whether `c`, fed from now on, can still meet its TTFT target (its prompt's tokens at
    the measured rate)."""
    return (c.ttft_deadline is not None
            and c.ttft_deadline - budget.now >= c.pending * budget.prefill_token_seconds)


def added_step_seconds(budget: Costs, rows: int, offloaded: int) -> float:
    """What one more decoding request, with `offloaded` layers on the host, adds to each
    step of `rows` decoding ones: its row (a step of rows + 1 against one of rows, where
    measured) and bringing its offloaded layers in."""
    by_rows = budget.decode_step_by_rows
    row = (by_rows[min(rows + 1, len(by_rows) - 1)] - by_rows[min(rows, len(by_rows) - 1)]
           if by_rows else 0.0)
    return max(row, 0.0) + offloaded * budget.offload_layer_seconds


def admission_keeps_slack(extra: float, new: Decoding, decodes: Sequence[Decoding],
                          budget: Costs, bring: float = 0.0, until: int | None = None
                          ) -> bool:
    """Whether admitting `new`, which makes each step `extra` seconds longer while it
    decodes and `bring` more while layers it put on the host are brought in (`until` steps;
    None: as long as it decodes), keeps every decoding request within its TPOT target
    (LayerKV eq. 1 over the steps to come, not only this one): over the steps both are
    expected to decode, the extra time must fit each one's slack; one already behind (slack
    below 0) only asks that each step stay within it. True while a cost or slack is unknown."""
    if extra + bring <= 0:
        return True
    for d in decodes:
        if d.tpot_slack is None or d.remaining is None or d.tpot_slo is None:
            continue
        if d.tpot_slack < 0:
            if budget.decode_step_seconds + extra + bring > d.tpot_slo:
                return False
            continue
        if _added_seconds(extra, bring, until, d, new) > d.tpot_slack:
            return False
    return True


def _added_seconds(extra: float, bring: float, until: int | None, d: Decoding,
                   new: Decoding) -> float:
    """What admitting `new` adds to decode `d`'s time over the steps both decode: `extra`
    each step, `bring` for the first `until` of them (None: all)."""
    steps = d.remaining if new.remaining is None else min(d.remaining, new.remaining)
    return extra * steps + bring * (steps if until is None else min(steps, until))


def admitting_runs_less_late(extra: float, new: Decoding, decodes: Sequence[Decoding],
                             budget: Costs, bring: float = 0.0, until: int | None = None,
                             own: float = 0.0) -> bool:
    """Where admitting `new` breaks the decodes' slack (`admission_keeps_slack`) or its own
    TPOT target (`own` seconds past it, `own_target_overrun`), whether it still runs the
    requests less far past their targets than holding it: admitted, each decode is late by
    what the longer steps take past its slack (all of them for one already behind), and
    `new` by `own`; held, `new` by its wait, until the first of them finishes at least,
    past its TTFT deadline. False with no deadline or no estimates to weigh."""
    step = budget.decode_step_seconds
    ends = [d.remaining * step for d in decodes if d.remaining]
    if new.ttft_deadline is None or new.remaining is None or not ends:
        return False
    late = max(own, 0.0)
    for d in decodes:
        if d.tpot_slack is not None and d.remaining is not None and d.tpot_slo is not None:
            late += max(0.0, _added_seconds(extra, bring, until, d, new)
                        - max(d.tpot_slack, 0.0))
    ready = budget.now + min(ends) + new.pending * budget.prefill_token_seconds
    return late < ready - new.ttft_deadline


def own_target_overrun(extra: float, offloaded: int, new: Decoding, budget: Costs,
                       decodes: Sequence[Decoding] | None = None, until: int | None = None,
                       bring: float = 0.0) -> float:
    """How far past its own TPOT target (seconds over its output; 0 or less: within it)
    `new`, with `offloaded` layers on the host, decodes: each step the decodes' now and
    `extra`, and `bring` while the layers on the host are brought in (`until` steps, None:
    all); one whose layers all fit is not held for its own sake (it only waits for the step
    to get no faster). For an admission with no one queued behind it (`decodes` given) and
    an output estimate, the target is met on average, as a miss is counted: its steps cost
    that while the longest of `decodes` still runs, then a step of its own row (a request
    arriving while the others near their end is not held for steps it will hardly share;
    with a queue behind it, others would take their places). Otherwise, and for a running
    request (its slack is weighed with the others'), each step within it."""
    if not offloaded or new.tpot_slo is None or not budget.decode_step_seconds:
        return 0.0
    shared = budget.decode_step_seconds + extra
    if decodes is None or not new.remaining:
        return (shared + bring - new.tpot_slo) * max(new.remaining or 1, 1)
    together = min(new.remaining, max((d.remaining or new.remaining for d in decodes),
                                      default=0))
    by_rows = budget.decode_step_by_rows
    alone = by_rows[1] if len(by_rows) > 1 else budget.decode_step_seconds
    brought = bring * (new.remaining if until is None else min(until, new.remaining))
    return (together * shared + (new.remaining - together) * alone + brought
            - new.remaining * new.tpot_slo)


def offload_beats_recompute(budget: Costs, layers: int, c: Decoding) -> bool:
    """Whether running request `c` decoding its remaining tokens with `layers` layers on the
    host (each step bringing them in: `offload_layer_seconds` each, added to the step every
    row waits for) costs the running requests less than preempting it, whose recompute of
    the tokens it holds delays them once. On a GPU bringing a layer in at every step can
    cost more than recomputing a short request's tokens once, so a request with many tokens
    still to go is preempted; on a CPU recompute is the dearer. True while a rate or the output
    estimate is not known."""
    s, p = budget.offload_layer_seconds, budget.prefill_token_seconds
    if not (s and p) or c.remaining is None:
        return True
    return layers * s * c.remaining <= c.held * p


def offload_beats_preempting(budget: Costs, extra: float, layers: int, c: Decoding,
                             running: Sequence[Decoding]) -> bool:
    """Whether running request `c` goes on with `layers` layers on the host, its steps and
    the others' `extra` seconds longer while it decodes, rather than being preempted.
    Without a TPOT target, where that costs the running requests less
    (`offload_beats_recompute`). With one, its own stall counts too, and the choice is the
    one that runs the decodes less far past their targets: going on, each decoding request
    among `running` is late by what the longer steps take past its slack (all of them for
    one already behind); preempted, `c` by its wait until the first other decode finishes
    and frees pages and the recompute of what it holds, past its own slack. Always where a
    recompute would not give back the KV it holds (`lossy_recompute`)."""
    s, p, step = budget.offload_layer_seconds, budget.prefill_token_seconds, \
        budget.decode_step_seconds
    if budget.lossy_recompute:
        return True
    if c.tpot_slo is None or c.remaining is None or not (s and p and step):
        return offload_beats_recompute(budget, layers, c)
    decodes = [d for d in running if d.pending == 1]
    ends = [d.remaining * step for d in decodes if d.remaining and d is not c]
    wait = min(ends, default=0.0)
    if layers * s * c.remaining > c.held * p + wait / len(decodes or [c]):
        return False  # (its wait shared over the rows, as a step's time is)
    late = 0.0
    for d in decodes:
        if d.tpot_slo is not None and d.remaining is not None:
            steps = min(d.remaining, c.remaining)
            slack = (d.tpot_slo - step) * steps if d.tpot_slack is None else d.tpot_slack
            late += max(0.0, extra * steps - max(slack, 0.0))
    own = (c.tpot_slo - step) * c.remaining if c.tpot_slack is None else c.tpot_slack
    return late <= max(0.0, wait + c.held * p - max(own, 0.0))


def offload_beats_waiting(budget: Costs, layers: int, new: Decoding,
                          decodes: Sequence[Decoding]) -> bool:
    """Whether admitting `new` now with `layers` layers on the host costs the requests less
    than it waiting would: each step it decodes in brings its layers in for every row
    (itself included), against its own wait, at least until the first decoding request
    finishes: its whole output, not only until pages free (no targets hold the next
    arrivals from moving layers out again). True while a rate or an estimate is unknown."""
    s = budget.offload_layer_seconds
    ends = [d.remaining * budget.decode_step_seconds for d in decodes if d.remaining]
    if not layers or not s or new.remaining is None or not ends or not budget.decode_step_seconds:
        return True
    if any(d.tpot_slo is not None for d in decodes):
        return True  # the decodes' TPOT targets say what their steps may cost (eq. 1)
    return (len(decodes) + 1) * layers * s * new.remaining <= min(ends)



def steps_until_freed(pages: int, running: Sequence[Decoding]) -> int | None:
    """The steps until the running requests expected to finish first (by their output
    estimates) have freed `pages` pages: how long layers moved to the host to admit a request
    stay there before the pool takes them back. None: not expected within the estimates."""
    if pages <= 0:
        return 0
    freed = 0
    for c in sorted((c for c in running if c.remaining is not None and c.pending == 1),
                    key=lambda c: c.remaining):
        freed += c.pin_pages
        if freed >= pages:
            return c.remaining
    return None


__all__ = ["Costs", "Decoding", "added_step_seconds", "admission_keeps_slack",
           "admitting_runs_less_late", "keeps_ttft", "offload_beats_preempting",
           "offload_beats_recompute", "offload_beats_waiting", "own_target_overrun",
           "steps_until_freed"]
