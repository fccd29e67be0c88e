"""A step's plan as the engine's rows: each planned request's tokens (a prompt chunk, a
layer-major prompt's span of layers, a decode's last token) as a `Row`. Pure over the
scheduler's records, so what a step feeds reads apart from the loop that applies the plan."""

from __future__ import annotations

from jkv.engine.engine import Row
from jkv.engine.layer_major import layers_for
from jkv.sched.plan_records import Plan
from jkv.sched.request import Request, Tracked


def step_rows(plan: Plan, by_id: dict[str, Request], state: dict[Request, Tracked],
              num_layers: int) -> tuple[list, list, list[int]]:
    """The step's rows: (prefill (request, Row) pairs, decode pairs, each prefill row's
    tokens of compute)."""
    prefill, decode, work = [], [], []
    for rid, n in plan.prefill:
        r = by_id[rid]
        st = state[r]
        work.append(n)
        if st.layers_done is not None:  # its whole prompt through the layers n buys
            rest, done = r.tokens[st.num_computed:], st.layers_done
            k = layers_for(n, len(rest), num_layers, done)
            prefill.append((r, Row(st.slot, rest, r.sampling, st.key, len(r.output),
                                   layer_span=(done, done + k))))
            continue
        chunk = r.tokens[st.num_computed: st.num_computed + n]
        targets = None
        if r.sampling.prompt_logprobs is not None:  # each position's next prompt token
            after = r.prompt[st.num_computed + 1: st.num_computed + n + 1]
            targets = list(after) + [-1] * (n - len(after))
        prefill.append((r, Row(st.slot, chunk, r.sampling, st.key, len(r.output), targets)))
    for rid in plan.decode:
        r = by_id[rid]
        st = state[r]
        decode.append((r, Row(st.slot, r.tokens[-1:], r.sampling, st.key, len(r.output))))
    return prefill, decode, work


__all__ = ["step_rows"]
