"""The scheduler's serving figures as plain numbers: what `LLM.stats()` returns and
`/metrics` exports."""

from __future__ import annotations

from typing import Protocol

from jkv.engine.engine import Engine
from jkv.sched.request import Request, SchedulerStats
from jkv.store.store import KVStore


class Serving(Protocol):
    """What the figures are read from (the scheduler)."""

    engine: Engine
    stats: SchedulerStats
    store: KVStore | None
    running: list[Request]
    num_waiting: int
    step_costs: dict[str, float]
    layer_offload: bool

    def requests_offloaded(self) -> int: ...


def snapshot(s: Serving) -> dict:
    """The figures of `s`, its engine and its store now (safe from other threads)."""
    eng, st = s.engine, s.engine.stats
    finished = eng.cache.finished
    out = {
        "num_requests_running": len(s.running),
        "num_requests_waiting": s.num_waiting,
        "kv_pages_used": eng.cache.pages_used,
        "kv_pages_total": eng.cache.total_pages,
        "kv_pages_cached": eng.cache.pages_cached,
        "prefix_hit_tokens": {"device": st.prefix_hit_tokens, **s.stats.restored_tokens},
        "prefix_query_tokens": st.prefix_query_tokens,
        "recomputed_tokens": s.stats.recomputed_tokens,
        "preemptions": s.stats.preemptions,
        "compilations": eng.num_compiles,
        "prompt_tokens_computed": st.prefill_tokens,
        "generation_tokens": st.decode_tokens,
        "steps": st.steps,
        "requests_finished": s.stats.finished,
        "requests_aborted": s.stats.aborted,
        # requests that ended normally: those that missed a target, by kind, and those
        # that kept every target they had (goodput; a request with none counts)
        "slo_violations": dict(s.stats.slo_violations),
        "requests_within_slo": s.stats.slo_met,
        # what the pool held per token of context as each sequence ended (all layers and
        # KV heads, scales included), averaged; tokens per tier, summed
        "kv_bytes_per_token": finished.bytes_per_token / max(finished.sequences, 1),
        "kv_tiers": dict(finished.tokens),
        "kv_compactions_refused": eng.cache.layout.tier_refusals,  # the pool was short
        # restored prompt tokens: loaded, or recomputed by split restores (per layer)
        "restore": {"tokens_loaded": st.restored_tokens - st.recomputed_tokens,
                    "tokens_recomputed": st.recomputed_tokens,
                    "recompute_ratio": st.recomputed_tokens / max(st.restored_tokens, 1)},
        # what the SLO checks took a step to cost at the last step, as learned from the
        # steps run (0 until measured): why an admission was held can be read off these
        "step_costs": dict(s.step_costs),
    }
    out["layer_offload"] = {  # LayerKV's layer-wise offload
        "enabled": s.layer_offload,
        "layers_offloaded": s.stats.layers_offloaded,
        "fetches": s.stats.layer_fetches,
        "admitted_offloaded": s.stats.admitted_offloaded,
        "layer_major_prefills": s.stats.layer_major_prefills,
        "admissions_held": s.stats.admissions_held,
        "bytes_to_host": eng.layers.offloaded_bytes,
        "bytes_from_host": eng.layers.fetched_bytes,
        "requests_offloaded": s.requests_offloaded()}
    if s.store is not None:
        out["store"] = {**s.store.snapshot(), "misses": s.stats.store_misses,
                        "restores_declined": s.stats.restores_declined,
                        "rebased_tokens": s.stats.rebased_tokens,
                        "restores_abandoned": s.stats.restores_abandoned,
                        # verified restores (`jkv.sched.restore_checks`)
                        "restores_verified": s.stats.restores_verified,
                        "restores_unverified": s.stats.restores_unverified,
                        "verify_failures": s.stats.verify_failures}
    return out
