"""The records the scheduler and its step policy (`jkv.sched.planning`) exchange: a request as the
policy sees it (`Candidate`), what one step may use and the cost model it is weighed with
(`Budget`), the step's work (`Plan`), and the queue's order. Plain numbers only, so the
policy is tested and simulated without a model or an engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from jkv.kv.page_cost import PageCost


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
    # layer-wise offload (running): layers in the pool when not all (None: all), the pages
    # offloading every resident layer frees, the pages fetching the offloaded ones takes
    resident: int | None = None
    offload_pages: int = 0
    fetch_pages: int = 0
    # output tokens it is still expected to generate (`OutputLengths`); None: not known
    remaining: int | None = None
    # a prompt fed layer-major (`jkv.engine.layer_major`): running, the layers it has run; waiting,
    # 0 when admitting it with layers on the host would feed it so (None: never)
    layer_major: int | None = None
    # waiting: preempted before, its layers on the host judged dearer than recomputing it,
    # or past a TPOT target (or not enough): admitted again only with every layer (back at
    # once with layers on the host, it would pay both, and be preempted again as the
    # decodes grow)
    whole: bool = False
    # waiting, preempted part way through a reply with a TPOT target: when its next token is
    # due on that target's schedule (absolute seconds; None: not preempted so)
    next_due: float | None = None


@dataclass(frozen=True)
class Budget:
    """What one step may use, and the cost model the TPOT cap estimates step time with."""

    available_pages: int  # free pages plus unreferenced cached blocks and kept whole rows
    free_slots: int
    max_tokens: int  # tokens per step, decode and prefill together
    chunk: int  # most tokens one request feeds in one step
    cost: PageCost  # the KV cache manager's: pages that tokens take
    now: float = 0.0
    decode_step_seconds: float = 0.0  # cost model: a step of decodes alone
    prefill_token_seconds: float = 0.0  # cost model: each prefill token on top (in full
    # chunks: a row's share included) ...
    prefill_row_seconds: float = 0.0  # ... and each prefill row (a call: dispatch, padding)
    # LayerKV: admit a prefill with some of its layers on the host, offload running requests'
    # layers instead of preempting them; an admitted prefill keeps `min_resident` layers at
    # least (eq. 4); the decodes' pages over `forecast_steps` steps must fit (eq. 5)
    layer_offload: bool = False
    # a preempted request's KV recomputed is not what it held (a token policy's placement
    # of a recomputed prompt is not the one it made token by token): offload, never preempt
    lossy_recompute: bool = False
    min_resident: int = 0
    forecast_steps: int = 1
    # cost model: what each offloaded layer a step brings in adds to it (measured)
    offload_layer_seconds: float = 0.0
    # cost model: a step of n decodes with every layer in the pool, at index n (on a CPU
    # each row costs its share of compute; empty: not measured, an admission costs no row)
    decode_step_by_rows: tuple[float, ...] = ()


@dataclass
class Plan:
    """The next step's work by request id; the scheduler turns it into an engine step."""

    preempt: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    prefill: list[tuple[str, int]] = field(default_factory=list)  # (request, tokens to feed)
    admit: list[str] = field(default_factory=list)  # waiting requests among `prefill`
    # layer-wise offload: running requests to keep only this many layers in the pool (the
    # rest offloaded before the step), running requests whose offloaded layers come back,
    # admitted requests that start with only this many layers in the pool
    offload: dict[str, int] = field(default_factory=dict)
    fetch: list[str] = field(default_factory=list)
    resident: dict[str, int] = field(default_factory=dict)
    # waiting requests whose pages fit (with layers on the host, or all in the pool), held
    # back because the steps they would decode in would cost a decoding request its TPOT
    # target (`admission_keeps_slack`) or their layers on the host would cost the decodes
    # more than their wait for pages (`offload_beats_waiting`)
    held: list[str] = field(default_factory=list)
    # admitted requests (with layers on the host) whose prompts are fed layer-major: each
    # step's tokens buy a share of its layers over the whole prompt (`layers_for`)
    layer_major: list[str] = field(default_factory=list)


def queue_order(c: Candidate) -> tuple:
    """Sort key of the queue (most important first); the store's hint follows it too. By
    deadline: a new request's TTFT deadline, a preempted one's next token's on its TPOT
    schedule where it has one (its TTFT deadline, met long ago, would put it before every
    new arrival however far ahead of its schedule it is), else its TTFT deadline."""
    deadline = c.next_due if c.next_due is not None else c.ttft_deadline
    return (c.priority, math.inf if deadline is None else deadline, c.arrival, c.request_id)



class Room(NamedTuple):
    """Layers of decoding requests moved to the host to admit one more (`_room`)."""

    running: list[Candidate]  # the running requests after the moves
    freed: int  # pages the moves free
    moved: int  # layers moved
    keeps: dict[str, int]  # each moved request's layers kept


__all__ = ["Budget", "Candidate", "Plan", "Room", "queue_order"]
