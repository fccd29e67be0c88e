"""Prometheus metrics, named as vLLM names them with a `jkv_` prefix.

Each `Metrics` has its own registry, so two servers in one process (tests) do not collide.
Counters and gauges are refreshed from a stats snapshot (`Scheduler.snapshot()`, the same
dict `LLM.stats()` returns); latency histograms are observed once per finished request.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TIERS = ("device", "host", "disk")
_STORE_TIERS = ("host", "disk")
_STORE_COUNTERS = (  # (key of stats()["store"], metric name, help)
    ("corrupt_entries", "jkv_store_corrupt_entries",
     "Stored KV entries that failed validation (served as misses, then deleted)."),
    ("evictions", "jkv_store_evictions", "Stored KV entries dropped to make room."),
    ("offloads", "jkv_store_offloads", "Stored KV entries moved from host to disk."),
    ("prefetches", "jkv_store_prefetches",
     "Stored KV entries moved from disk to host ahead of their request."),
    ("saves", "jkv_store_saves", "KV entries written to the store."),
    ("shared_entries", "jkv_store_shared_entries",
     "KV entries written in the shared-layer form (kv_sharing krul)."),
    ("shared_groups", "jkv_store_shared_groups",
     "Groups of several layers sharing one basis in the shared-layer entries written."),
    ("shared_bytes_saved", "jkv_store_shared_bytes_saved",
     "Bytes the shared-layer entries written took fewer than in the pool's format."),
    ("shared_refused", "jkv_store_shared_refused",
     "KV entries the shared-layer form would have kept poorly: written in the pool's format."),
    ("lossless_entries", "jkv_store_lossless_entries",
     "KV entries stored without the front blocks a split restore recomputes (Krul)."),
    ("lossless_bytes_saved", "jkv_store_lossless_bytes_saved",
     "Bytes of pages those entries left out, recomputed when they are restored."),
    ("written_through", "jkv_store_written_through",
     "KV entries kept in host memory also written to the persistent tier several replicas "
     "share (store_coordinator), where the others find them."),
    ("write_through_failures", "jkv_store_write_through_failures",
     "Such copies the shared tier refused (its coordinator gone, no room): the entry stays "
     "in this replica's host memory only."),
    ("converted_loads", "jkv_store_converted_loads",
     "Stored KV entries read in another KV form and converted to the pool's (approximate)."),
    ("disk_resets", "jkv_store_disk_resets",
     "Persistent KV stores found damaged when opened (their files moved aside to a dated "
     "sibling folder, started empty)."),
    ("loads", "jkv_store_loads", "Stored KV entries read for a restore."),
    ("read_failures", "jkv_store_read_failures",
     "Reads of stored KV entries that raised (a failing tier): misses, recomputed."),
    ("superseded", "jkv_store_superseded",
     "Stored KV entries replaced by a longer one of the same prefix."),
    ("save_failures", "jkv_store_save_failures",
     "KV saves that raised (logged; no request affected)."),
    ("saves_dropped", "jkv_store_saves_dropped",
     "KV saves not stored: the writer too far behind, no room made, or the disk refused them "
     "twice."),
    ("save_retries", "jkv_store_save_retries",
     "KV saves the disk refused for want of space, retried once in the room eviction made."),
    ("disk_full", "jkv_store_disk_full",
     "Writes to the persistent KV tier refused for want of space (its budget lowered to "
     "what the filesystem holds)."),
    ("compactions", "jkv_store_compactions",
     "Compactions of the persistent KV tier (deleted entries' bytes given back to the "
     "filesystem)."),
    ("rebased_tokens", "jkv_store_rebased_tokens",
     "Restored tokens re-rotated for a truncated conversation."),
    ("misses", "jkv_store_misses",
     "Store hits that could not be restored (gone, corrupt, a failing tier): recomputed."),
    ("restores_declined", "jkv_store_restores_declined",
     "Store hits recomputed because that was measured to be faster than loading them."),
    ("restores_abandoned", "jkv_store_restores_abandoned",
     "Store hits whose read outlasted recomputing them: recomputed."),
    ("verify_failures", "jkv_store_verify_failures",
     "Restores whose first computed token's state was further from the one stored with the "
     "entry than the KV format's tolerance: discarded, recomputed, the entry quarantined."),
    ("restores_verified", "jkv_store_restores_verified",
     "Restores whose first computed token's state matched the one stored with the entry."),
    ("restores_unverified", "jkv_store_restores_unverified",
     "Restores not checked: the entry keeps no state of the token after it, the prompt goes "
     "on with another token, or the KV format's tolerance was not measured."),
    ("quarantined", "jkv_store_quarantined",
     "Stored KV entries never served again after a restore of them failed its check "
     "(with every entry sharing their chain; deleted)."),
)
_GAUGES = (  # (stats key = metric name without the prefix, help)
    ("num_requests_running", "Requests holding a sequence slot."),
    ("num_requests_waiting", "Requests queued for admission."),
    ("kv_pages_used", "Device KV pages held by sequences and the prefix cache."),
    ("kv_pages_total", "Device KV pages in the pool."),
    ("kv_pages_cached", "Device KV pages kept for reuse (prefix-cache blocks, kept rows), "
     "counted in kv_pages_used: a filling cache, not a leak."),
    ("kv_bytes_per_token", "KV bytes the pool held per token of context as each sequence "
     "ended, averaged over the sequences."),
)
_COUNTERS = (  # (stats key, metric name, help); prometheus adds the _total suffix
    ("prefix_query_tokens", "jkv_prefix_cache_query_tokens",
     "Prompt tokens looked up in the prefix cache."),
    ("recomputed_tokens", "jkv_recomputed_tokens", "Tokens computed again after a preemption."),
    ("preemptions", "jkv_preemptions", "Running requests preempted."),
    ("compilations", "jkv_compilations", "Compiled step variants."),
    ("prompt_tokens_computed", "jkv_prompt_tokens", "Prompt tokens run through the model."),
    ("generation_tokens", "jkv_generation_tokens", "Tokens decoded."),
    ("requests_within_slo", "jkv_goodput_requests",
     "Requests that ended normally within every TTFT/TPOT target they had."),
)


_OFFLOAD_COUNTERS = (  # (key of stats()["layer_offload"], metric name, help)
    ("layers_offloaded", "jkv_layer_offload_layers",
     "Layers of running requests moved to host memory instead of preempting (LayerKV)."),
    ("fetches", "jkv_layer_offload_fetches",
     "Running requests whose offloaded layers came back into device pages."),
    ("admitted_offloaded", "jkv_layer_offload_admissions",
     "Requests admitted with some layers' KV in host memory."),
    ("layer_major_prefills", "jkv_layer_offload_layer_major_prefills",
     "Of those, prompts fed a layer at a time over all their tokens (each offloaded layer "
     "taken and sent out once)."),
    ("admissions_held", "jkv_layer_offload_admissions_held",
     "Requests whose admission waited although their pages fit (all layers, or some in host "
     "memory): the steps they would slow would have cost a running request its TPOT "
     "target, or their layers in host memory would have cost the running requests more than "
     "their wait."),
    ("bytes_to_host", "jkv_layer_offload_bytes_to_host", "KV bytes copied to host memory."),
    ("bytes_from_host", "jkv_layer_offload_bytes_from_host",
     "KV bytes copied back into device pages."),
)


class Metrics:
    def __init__(self) -> None:
        disable_created_metrics()  # no `_created` twin of every counter and histogram
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("jkv_time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("jkv_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("jkv_e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("jkv_request_queue_time_seconds", "Arrival to admission (the "
                               "queueing part of TTFT, tokenizing included).",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.slo_violations = Counter("jkv_slo_violations", "Requests that missed their "
                                      "TTFT or TPOT target, by kind.", ["kind"], registry=r)
        for kind in ("ttft", "tpot"):
            self.slo_violations.labels(kind=kind)
        self.gauges = {key: Gauge(f"jkv_{key}", doc, registry=r) for key, doc in _GAUGES}
        # the server's, not the scheduler's: its /metrics route sets it
        self.tokenizing = Gauge("jkv_num_requests_tokenizing", "Requests waiting for or "
                                "under tokenization (the server's tokenizer pool); with "
                                "num_requests_waiting, what the server's queue limit counts.",
                                registry=r)
        self.hits = Counter("jkv_prefix_cache_hit_tokens", "Prompt tokens found cached, "
                            "by tier.", ["tier"], registry=r)
        self.counters = {key: Counter(name, doc, registry=r) for key, name, doc in _COUNTERS}
        for tier in _TIERS:
            self.hits.labels(tier=tier)
        self.store_bytes = Gauge("jkv_store_bytes", "Bytes of KV entries held, by store tier.",
                                 ["tier"], registry=r)
        self.store_capacity = Gauge("jkv_store_capacity_bytes", "Byte budget of each store "
                                    "tier.", ["tier"], registry=r)
        self.store_entries = Gauge("jkv_store_entries", "KV entries held, by store tier.",
                                   ["tier"], registry=r)
        self.store_counters = {key: Counter(name, doc, registry=r)
                               for key, name, doc in _STORE_COUNTERS}
        self.store_read_rate = Gauge("jkv_store_read_bytes_per_second", "Measured rate of "
                                     "reading stored KV entries, by store tier (0: not yet).",
                                     ["tier"], registry=r)
        self.store_convert_rate = Gauge("jkv_store_convert_bytes_per_second", "Measured rate "
                                        "of converting stored entries of each KV format into "
                                        "the pool's (stored bytes).", ["kv_format"], registry=r)
        self.store_half_life = Gauge("jkv_store_adapt_half_life_seconds", "AdaptCache: "
                                     "seconds over which an entry's count of uses halves "
                                     "(learned from the gaps between uses unless set).",
                                     registry=r)
        self.offload_counters = {key: Counter(name, doc, registry=r)
                                 for key, name, doc in _OFFLOAD_COUNTERS}
        self.offloaded_requests = Gauge("jkv_layer_offload_requests", "Running requests "
                                        "with some layers' KV in host memory.", registry=r)
        self.step_costs = Gauge("jkv_step_cost_seconds", "What the scheduler's SLO checks "
                                "take a step's parts to cost, learned from the steps run: "
                                "decode (a step of one decode), decode_full (of as many as "
                                "run together), prefill_token (each prompt token on top), "
                                "prefill_row (each prefill row: its call), offload_layer "
                                "(each offloaded layer a step brings in).",
                                ["part"], registry=r)
        self._seen: dict[str, float] = {}

    def _advance(self, counter, name: str, value: float) -> None:
        delta = value - self._seen.get(name, 0)
        if delta > 0:
            counter.inc(delta)
            self._seen[name] = value

    def sync(self, stats: dict) -> None:
        """Bring gauges and counters up to a stats snapshot."""
        for name, gauge in self.gauges.items():
            gauge.set(stats[name])
        for name, counter in self.counters.items():
            self._advance(counter, name, stats[name])
        for tier in _TIERS:
            self._advance(self.hits.labels(tier=tier), f"hit/{tier}",
                          stats["prefix_hit_tokens"][tier])
        for part, seconds in stats["step_costs"].items():
            self.step_costs.labels(part=part).set(seconds)
        for kind, n in stats["slo_violations"].items():
            self._advance(self.slo_violations.labels(kind=kind), f"slo/{kind}", n)
        store = stats.get("store")
        if store is not None:
            for tier in _STORE_TIERS:
                self.store_bytes.labels(tier=tier).set(store["bytes"][tier])
                self.store_capacity.labels(tier=tier).set(store["capacity_bytes"][tier])
                self.store_entries.labels(tier=tier).set(store["entries"][tier])
            for key, counter in self.store_counters.items():
                self._advance(counter, f"store/{key}", store[key])
            for tier in _STORE_TIERS:
                self.store_read_rate.labels(tier=tier).set(store["read_bytes_per_s"][tier])
            for fmt, rate in store["convert_bytes_per_s"].items():
                self.store_convert_rate.labels(kv_format=fmt).set(rate)
            if "adapt_half_life_s" in store:
                self.store_half_life.set(store["adapt_half_life_s"])
        offload = stats.get("layer_offload")
        if offload is not None:
            self.offloaded_requests.set(offload["requests_offloaded"])
            for key, counter in self.offload_counters.items():
                self._advance(counter, f"offload/{key}", offload[key])

    def observe_finished(self, request) -> None:
        """Latency histograms for a finished request (a `jkv.sched.scheduler.Request`)."""
        if request.first_token_time is None or request.finish_time is None:
            return
        self.ttft.observe(request.first_token_time - request.arrival)
        if request.admit_time is not None:
            self.queue.observe(request.admit_time - request.arrival)
        self.e2e.observe(request.finish_time - request.arrival)
        if len(request.output) > 1:
            self.tpot.observe((request.finish_time - request.first_token_time)
                              / (len(request.output) - 1))

    def render(self) -> bytes:
        """The text exposition format, for GET /metrics."""
        return generate_latest(self.registry)
