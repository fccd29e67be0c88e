"""What a step's plan is weighed from: the step's `Budget` (the engine's capacity now and the
learned step costs) and each request's `Candidate`. Reads of plain numbers, kept apart from
the serving loop (`jkv.sched.scheduler`), which holds the requests and changes them."""

from __future__ import annotations

import dataclasses

from jkv.engine.engine import Engine
from jkv.sched.output_lengths import OutputLengths
from jkv.sched.plan_records import Budget, Candidate
from jkv.sched.planning import min_resident
from jkv.sched.request import Request, Tracked
from jkv.sched.step_costs import StepCosts

FORECAST_STEPS = 4  # layer offload (LayerKV eq. 5): decodes' pages over this many steps


def step_budget(engine: Engine, costs: StepCosts, max_tokens: int, layer_offload: bool,
                now: float, token_s: float, decode_step_s: float) -> Budget:
    """What a step may use: `max_tokens` tokens, the engine's pages and slots now, weighed
    with the learned costs (`token_s`: a prompt token fed in full chunks; `decode_step_s`: a
    step of the requests decoding now)."""
    eng = engine
    return Budget(
        available_pages=eng.cache.available_pages, free_slots=eng.cache.num_free_slots,
        max_tokens=max_tokens, chunk=eng.prefill_chunk, cost=eng.cache.cost,
        now=now, decode_step_seconds=decode_step_s,
        prefill_token_seconds=token_s,
        prefill_row_seconds=costs.prefill_row_s, layer_offload=layer_offload,
        lossy_recompute=eng.cache.lossy_recompute,
        offload_layer_seconds=costs.offload_layer_s,
        decode_step_by_rows=tuple(costs.decode(n) for n in range(eng.runner.max_rows + 1)),
        min_resident=min_resident(
            eng.cfg.num_layers, eng.cache.one_page * eng.cfg.num_kv_heads / eng.page_size,
            eng.layers.offload_bytes_per_s, token_s),
        forecast_steps=FORECAST_STEPS)


def cost_figures(budget: Budget) -> dict[str, float]:
    """The step costs a plan was weighed with, by part: what the stats show of them."""
    return {"decode": budget.decode_step_by_rows[1],
            "decode_full": budget.decode_step_by_rows[-1],
            "prefill_token": budget.prefill_token_seconds,
            "prefill_row": budget.prefill_row_seconds,
            "offload_layer": budget.offload_layer_seconds}


def request_candidate(r: Request, held: int, pin_pages: int, running: bool,
                      lengths: OutputLengths) -> Candidate:
    """`r` as planning sees it, holding `held` tokens and pinning `pin_pages` pages."""
    # (a preempted request keeps its deadline, met long ago: it orders the queue, and
    # without one it went behind every later arrival that had one and stalled its stream)
    ttft = None if r.ttft_slo_ms is None else r.arrival + r.ttft_slo_ms / 1000
    tpot = None if r.tpot_slo_ms is None else r.tpot_slo_ms / 1000
    # (what admission weighs the cost of its steps over; not known before any reply)
    remaining = (lengths.remaining(r.session_id, r.sampling.max_tokens, len(r.output))
                 if lengths.recent else None)
    due = (r.first_token_time + len(r.output) * tpot
           if not running and r.output and tpot is not None and r.first_token_time is not None
           else None)  # (a preempted request: its next token on its TPOT schedule)
    return Candidate(r.request_id, r.arrival, len(r.tokens) - held, held, running,
                     r.priority, pin_pages, ttft, tpot, remaining=remaining,
                     whole=not running and r.num_preemptions > 0, next_due=due)


def with_layers(c: Candidate, engine: Engine, st: Tracked) -> Candidate:
    """A running request's candidate with its layers as LayerKV's offload weighs them: those
    in the pool, the pages offloading or fetching them moves, its layer-major progress."""
    cache = engine.cache
    resident = cache.resident(st.slot)
    mid_prompt = st.layers_done is not None  # (its layers move only once it is done)
    return dataclasses.replace(
        c, resident=None if resident == cache.num_layers else resident,
        offload_pages=0 if mid_prompt else cache.pages_offloadable(st.slot),
        fetch_pages=0 if mid_prompt else engine.pages_to_fetch(st.slot),
        layer_major=st.layers_done)


def with_tpot_slack(c: Candidate, r: Request, now: float, lengths: OutputLengths,
                    step_s: float) -> Candidate:
    """A decoding request's candidate with its TPOT slack (LayerKV eq. 1): what its target
    allows over the whole output, less what it has used and what its remaining tokens'
    decode steps will take (each `step_s`, as long as a step of the requests decoding now,
    layers brought in included). Unchanged where that is not known: no target, no token yet
    or no step of decodes measured."""
    if c.tpot_slo is None or r.first_token_time is None or not step_s:
        return c
    m = lengths.remaining(r.session_id, r.sampling.max_tokens, len(r.output))
    slack = ((len(r.output) - 1 + m) * c.tpot_slo - (now - r.first_token_time)
             - m * step_s)
    return dataclasses.replace(c, tpot_slack=slack, remaining=m)


__all__ = ["FORECAST_STEPS", "cost_figures", "request_candidate", "step_budget",
           "with_layers", "with_tpot_slack"]
