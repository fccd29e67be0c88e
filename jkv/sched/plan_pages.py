"""Pages a step's work takes, as pure arithmetic over `PageCost` and the candidates: what a
request adds with some layers resident (LayerKV), what a prefill fed layer-major takes, the
decodes' pages over the next steps, and the decodes' layers that could move to the host to
admit one more (`room_for_admission`). `planning.plan_step` decides with these.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jkv.kv.page_cost import PageCost
from jkv.sched.plan_records import Budget, Candidate, Room


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


def decode_pages(cost: PageCost, running: Sequence[Candidate], steps: int) -> int:
    """Pages the decoding requests among `running` take over the next `steps` steps."""
    return sum(step_pages(cost, c.resident, c.held, steps) for c in running if c.pending == 1)


def moved_layers(c: Candidate, resident: int, k: int) -> Candidate:
    """Running request `c`, with `resident` layers in the pool, after `k` of them move to
    the host (each its own pages in one layer)."""
    per = c.offload_pages // resident
    return dataclasses.replace(c, resident=resident - k, offload_pages=per * (resident - k),
                               fetch_pages=c.fetch_pages + per * k)


def forecast(cost: PageCost, running: Sequence[Candidate], horizon: int) -> int:
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


def room_for_admission(keep: list[Candidate], need: int, budget: Budget, fetched: set[str]
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
        per, before = c.offload_pages // r, decode_pages(cost, keep, 1)
        for k in range(1, r + 1):
            trial = keep[:i] + [moved_layers(c, r, k)] + keep[i + 1:]
            gain = per * k - (decode_pages(cost, trial, 1) - before)
            if freed + gain >= need:
                break
        if gain <= 0:
            continue
        keep, freed, moved = trial, freed + gain, moved + k
        keeps[c.request_id] = r - k
        if freed >= need:
            return Room(keep, freed, moved, keeps)
    return None


def layers_on_host(cost: PageCost, c: Candidate) -> int:
    return 0 if c.resident is None else cost.layers - c.resident
