"""serve_slo's workload replayed through jkv's own scheduler and page accounting, with each
step's time taken from a device's measured costs instead of a clock: what the three LayerKV
settings would do on a GPU, for choosing a GPU run's workload and checking a policy on a
machine without one. A prediction, never a result: the numbers it prints are modeled.

The engine is real (`Engine` + `Scheduler`, every page taken and freed, layers offloaded,
fetched and fed layer-major exactly as in serving) but runs a tiny model with the shape that
matters to the pages (layers, KV heads) on the CPU; the pool holds as many tokens as
`--kv-cache-bytes` holds at the modeled model's KV size. Time is virtual: it moves only by
the modeled seconds of each step, fetch and offload (`Costs`), and the scheduler reads it as
its clock, so its learned step costs, TPOT slack and SLO checks all see modeled time.

    python benchmarks/serve_replay.py      # serve_slo's GPU workload (gpu_session.sh 5)
    python benchmarks/serve_replay.py --kv-cache-bytes 1200000000 --max-tokens 64
    python benchmarks/serve_replay.py --costs cpu-smollm2-f32 --requests 24 \
        --rates 0.1,0.2 --lengths 512,1024 --max-tokens 192 --ttft-slo-ms 5000 \
        --tpot-slo-ms 100 --max-model-len 1280 --kv-cache-bytes 120000000 \
        --max-num-seqs 8                       # serve_slo's decode-heavy run on this CPU

Beyond serve_slo's figures it reports each request's longest wait between two of its tokens
(`max_gap_ms`; `stall` in the table: the longest over a rate's requests): where a TPOT tail
comes from a decode preempted part way (its wait for pages and its recompute), not from
steps that are all a little slower.

`Costs` presets hold the figures they came from (committed results of device and CPU runs).
What was never measured on the device is marked as a guess there.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
from harness import write_results
from serve import pct
from serve_slo import make_requests
from tqdm import tqdm

import jkv.sched.scheduler
from jkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jkv.engine.engine import Engine
from jkv.engine.sampling import SamplingParams
from jkv.kv.buckets import decode_bucket
from jkv.models.loaders import random_params
from jkv.sched.scheduler import Request, Scheduler


@dataclass(frozen=True)
class Costs:
    """Seconds of a step's parts on one device and model (`step` puts them together)."""

    kv_bytes_per_token: int  # all layers
    layers: int
    decode_s: float  # a step of one decode, every layer in the pool
    decode_row_s: float  # each further row
    decode_context_s: float  # per token of context over the step's rows
    prefill_token_s: float  # a prompt token through every layer ...
    prefill_quadratic_s: float  # ... and per token of context before it
    bring_layer_s: float  # one offloaded layer of one row brought in a decode step ...
    bring_context_s: float  # ... and per token of that row's context
    layer_call_s: float  # a layer-major call (one layer over a chunk): its host floor
    copy_layer_s: float  # fetch / offload: per layer moved ...
    copy_bytes_per_s: float  # ... and its bytes
    shape_step: int  # the engine's row buckets there (a padded row costs a row)
    source: str
    prefill_row_s: float = 0.0  # each prefill row's own call (its padding, the weights read)
    overlap: bool = True  # a step's decodes and prefills hide each other (else they add up)

    def step(self, decode_ctx: list[int], prefill: list[tuple[int, int, float]],
             brings: list[int], layer_calls: int) -> float:
        """A step of decodes at these contexts, prefill rows (tokens, context before them,
        share of the layers they go through), offloaded layers brought in (one entry per
        layer and row: that row's context) and layer-major calls: the decodes' time and the
        prefill's overlap where `overlap` (a device whose steps are bound by reading the
        weights, which both do once) and add up where not (a CPU's compute-bound calls),
        the brings add to it."""
        rows = decode_bucket(len(decode_ctx), self.shape_step)
        dec = 0.0 if not decode_ctx else (self.decode_s + self.decode_row_s * (rows - 1)
                                          + self.decode_context_s * sum(decode_ctx))
        pre = sum(share * (self.prefill_row_s + n * (self.prefill_token_s
                                                      + self.prefill_quadratic_s * (c + n / 2)))
                  for n, c, share in prefill)
        pre = max(pre, layer_calls * self.layer_call_s)
        bring = sum(self.bring_layer_s + self.bring_context_s * c for c in brings)
        return (max(dec, pre) if self.overlap else dec + pre) + bring

    def copy(self, layers: int, tokens: int) -> float:
        """Moving `layers` layers of `tokens` tokens between the pool and the host."""
        return layers * (self.copy_layer_s
                         + tokens * self.kv_bytes_per_token / self.layers / self.copy_bytes_per_s)


COSTS = {
    # H200, Llama-3-8B shape, random weights, bf16, JAX 0.11.2 (benchmarks/results/<script>/):
    # decode 15.6 ms (2K) / 15.9 ms (8K) at one row, 16.3 / 18.1 ms at 8 / 32 rows
    # (tier_cost-nvidia_h200-llama3-8b-2026-11-26.json: none_k8v4t); resident prefill 93 ms (2K)
    # and 429 ms (8K), fitted as a + b x context; decode with every layer offloaded 55.6 ms
    # (2K) / 75.6 ms (8K) and with 16 of 32 37.7 / 43.0 (pinned copies), fitted per layer
    # brought; fetch of 32 layers 32 ms (2K) / 41 ms (8K)
    # (layer_offload-nvidia_h200-llama3-8b-2026-11-27-pinned.json). Guesses (not measured there):
    # a layer-major call's host floor (a layer step's dispatch, 0.45 ms in the 11-27 trace),
    # an offload costing what a fetch does.
    "h200-llama3-8b": Costs(
        kv_bytes_per_token=32 * 8 * 128 * 2 * 2, layers=32,
        decode_s=0.0155, decode_row_s=0.00008, decode_context_s=0.05e-6,
        prefill_token_s=42.8e-6, prefill_quadratic_s=2.34e-9,
        bring_layer_s=1.04e-3, bring_context_s=0.103e-6, layer_call_s=0.45e-3,
        copy_layer_s=0.78e-3, copy_bytes_per_s=60e9, shape_step=4,
        source="layer_offload-nvidia_h200-llama3-8b-2026-11-27-pinned.json, "
               "tier_cost-nvidia_h200-llama3-8b-2026-11-26.json"),
    # This CPU (2 cores), SmolLM2-135M float32, JAX 0.10.2: decode at one row 23.8 ms (1K) /
    # 38.8 ms (4K), with every layer offloaded 39.4 / 66.4 ms, resident prefill 0.77 s (1K) /
    # 4.67 s (4K), fetch of 30 layers 13.7 / 34.7 ms, a layer-major prefill within 3% of a
    # resident one (layer_offload-cpu-2026-11-27-layer-major.json); 4 rows 37 ms a step at short
    # context (cpu_throughput-2026-11-24-2.json), 32 rows at 512 148 ms
    # (tier_cost-cpu-2026-11-27.json):
    # rows and context fitted together, within 20% of each: decode 18.8 ms + 3 ms a padded row,
    # prefill 0.63 ms a token. Served (serve_slo's server and its client on the same 2 cores)
    # a step costs more: decode 26 ms + 6 ms a row and prefill 0.8 ms a token replay serve_slo's
    # no-offload run (serve_slo-cpu-2026-11-27-decode-heavy-24-weighed.json: TTFT mean / p99 1.85 /
    # 9.1 s and 14.6 / 27.0 s at 0.1 / 0.2 a second, TPOT p50 36 / 60 ms; replayed 1.78 / 8.7,
    # 12.4 / 23.6 s, 38 / 60 ms), so those are the preset's. Guesses: an offload costing a
    # fetch, a layer-major call's floor (hidden in the 3%).
    "cpu-smollm2-f32": Costs(
        kv_bytes_per_token=30 * 3 * 64 * 2 * 4, layers=30,
        decode_s=0.026, decode_row_s=0.006, decode_context_s=4.0e-6,
        prefill_token_s=0.8e-3, prefill_quadratic_s=0.25e-6,
        bring_layer_s=0.39e-3, bring_context_s=0.13e-6, layer_call_s=0.2e-3,
        copy_layer_s=0.22e-3, copy_bytes_per_s=6.7e9, shape_step=2,
        source="layer_offload-cpu-2026-11-27-layer-major.json, "
               "cpu_throughput-2026-11-24-2.json, tier_cost-cpu-2026-11-27.json"),
}


class VirtualClock:
    """What the scheduler reads as `time`: seconds that move only when `advance` says."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Modeled:
    """An engine whose step, fetch and offload advance the clock by their modeled seconds
    (the work itself runs, on the tiny model), each times a random factor where `jitter`
    is given: lognormal with that sigma and mean 1 (a shared machine's steps vary; the
    scheduler's learned costs and SLO checks see them vary as in serving)."""

    def __init__(self, engine: Engine, costs: Costs, clock: VirtualClock,
                 jitter: float = 0.0, seed: int = 0) -> None:
        self.engine, self.costs, self.clock = engine, costs, clock
        self.jitter, self.rng = jitter, np.random.default_rng(seed)
        self.seconds = {"step": 0.0, "fetch": 0.0, "offload": 0.0}
        step, fetch, keep = engine.step, engine.fetch_layers, engine.keep_resident

        def timed_step(prefill, decode):
            s = self._step_seconds(prefill, decode)
            out = step(prefill, decode)
            self._spend("step", s)
            return out

        def timed_fetch(slot):
            s = costs.copy(len(engine.offloaded_layers(slot)), self._tokens(slot))
            fetch(slot)
            self._spend("fetch", s)

        def timed_keep(slot, n):
            moved = keep(slot, n)
            self._spend("offload", costs.copy(moved, self._tokens(slot)))
            return moved

        engine.step, engine.fetch_layers, engine.keep_resident = timed_step, timed_fetch, timed_keep

    def close(self) -> None:
        """The engine's own methods again."""
        for name in ("step", "fetch_layers", "keep_resident"):
            vars(self.engine).pop(name, None)

    def _spend(self, what: str, seconds: float) -> None:
        if self.jitter:
            seconds *= float(self.rng.lognormal(-self.jitter**2 / 2, self.jitter))
        self.seconds[what] += seconds
        self.clock.advance(seconds)

    def _tokens(self, slot: int) -> int:
        return len(self.engine.cache.slot_tokens[slot])

    def _step_seconds(self, prefill, decode) -> float:
        eng, layers = self.engine, self.costs.layers
        decode_ctx, rows, brings, calls = [], [], [], 0
        for r in decode:
            c = self._tokens(r.slot)
            decode_ctx.append(c)
            brings += [c] * len(eng.offloaded_layers(r.slot))
        for r in prefill:
            c, n = self._tokens(r.slot), len(r.tokens)
            if r.layer_span is not None:  # layer-major: its layers over all its tokens
                k = r.layer_span[1] - r.layer_span[0]
                rows.append((n, c, k / layers))
                calls += k * math.ceil(n / eng.prefill_chunk)
            else:
                rows.append((n, c, 1.0))
                brings += [c + n] * len(eng.offloaded_layers(r.slot))
        return self.costs.step(decode_ctx, rows, brings, calls)


def tiny_engine(costs: Costs, args) -> Engine:
    """A model with the modeled one's layers and little else (one KV head: every head of a
    layer takes the same pages, so one head's count is the accounting of all), its pool as
    many tokens as `--kv-cache-bytes` holds at the modeled KV size."""
    cfg = ModelConfig(vocab_size=512, hidden_size=16, intermediate_size=16,
                      num_layers=costs.layers, num_heads=1, num_kv_heads=1, head_dim=8,
                      rope_theta=10000.0,
                      max_position_embeddings=args.max_model_len)
    tokens = args.kv_cache_bytes // costs.kv_bytes_per_token
    tiny_per_token = cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * 4  # float32
    return Engine(cfg, random_params(cfg, seed=0, dtype=jnp.float32),
                  cache=CacheConfig(kv_cache_bytes=int(tokens * tiny_per_token)),
                  config=EngineConfig(max_model_len=args.max_model_len,
                                      max_num_seqs=args.max_num_seqs,
                                      prefill_chunk=args.prefill_chunk,
                                      enable_prefix_caching=False),
                  shape_step=costs.shape_step)


def _run(sched: Scheduler, clock: VirtualClock, todo: list[Request], step_s: float) -> None:
    """Feed `todo` (arrivals in clock seconds) to the scheduler until all are finished."""
    pending = sorted(todo, key=lambda r: r.arrival)
    for _ in range(500_000):  # bounded: a stalled loop fails instead of hanging
        while pending and pending[0].arrival <= clock.now:
            sched.add(pending.pop(0))
        if not pending and not sched.num_unfinished:
            return
        if not sched.num_unfinished:
            clock.now = pending[0].arrival
            continue
        before = clock.now
        sched.step()
        if clock.now == before:  # nothing ran (all held): time passes a step's worth
            clock.advance(step_s)
    raise RuntimeError("requests still unfinished")


class StallMeter:
    """Each request's longest wait between two of its tokens, in modeled seconds: a decode
    preempted part way stalls for its wait and recompute (the tail of TPOT), where a slow
    step only stretches every gap a little. `on_token` is the requests' hook."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock, self.last, self.longest = clock, {}, {}

    def on_token(self, r: Request, token: int) -> bool:
        now, key = self.clock.now, r.request_id
        if key in self.last:
            self.longest[key] = max(self.longest.get(key, 0.0), now - self.last[key])
        self.last[key] = now
        return False  # never stops a request


def _summary(todo: list[Request], args, stats: dict, before: dict,
             stalls: StallMeter) -> dict:
    ttft = [r.first_token_time - r.arrival for r in todo]
    tpot = [(r.finish_time - r.first_token_time) / (len(r.output) - 1) for r in todo]
    missed = [a > args.ttft_slo_ms / 1000 or b > args.tpot_slo_ms / 1000
              for a, b in zip(ttft, tpot, strict=True)]
    return {"ttft_mean_s": float(np.mean(ttft)), "ttft_p99_s": pct(ttft, 99),
            "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99),
            "slo_violation_rate": float(np.mean(missed)),
            # the longest any request waited between two of its tokens
            "max_gap_s": max(stalls.longest.get(r.request_id, 0.0) for r in todo),
            **{k: v - before.get(k, 0) for k, v in stats.items()},
            # each request, in arrival order: where a tail comes from (as serve_slo's)
            "per_request": [{"arrival_s": round(r.arrival - todo[0].arrival, 3),
                          "prompt": len(r.prompt), "ttft_s": round(a, 3),
                          "tpot_ms": round(b * 1000, 1), "preemptions": r.num_preemptions,
                          "max_gap_ms": round(stalls.longest.get(r.request_id, 0.0) * 1000, 1)}
                         for r, a, b in zip(todo, ttft, tpot, strict=True)]}


COUNTED = ("preemptions", "layers_offloaded", "admitted_offloaded", "layer_major_prefills",
           "layer_fetches", "admissions_held")


def replay(engine: Engine, costs: Costs, setting: str, warm: list[dict],
           by_rate: dict[str, list[dict]], args) -> dict[str, dict]:
    """One setting as serve_slo runs it on one server: the warm-up requests one at a time,
    then each rate's requests; the summary serve_slo prints, per rate."""
    clock = VirtualClock()
    real_time = jkv.sched.scheduler.time
    jkv.sched.scheduler.time = clock  # the scheduler's only clock
    model = Modeled(engine, costs, clock, args.jitter, args.jitter_seed)
    slo = setting == "offload + SLO"
    stalls = StallMeter(clock)
    out = {}

    def requests(reqs: list[dict], start: float) -> list[Request]:
        return [Request([int(t) for t in r["prompt"]],
                        SamplingParams(max_tokens=args.max_tokens, temperature=0),
                        arrival=start + r["arrival"],
                        ttft_slo_ms=args.ttft_slo_ms if slo else None,
                        tpot_slo_ms=args.tpot_slo_ms if slo else None,
                        on_token=stalls.on_token) for r in reqs]

    try:
        sched = Scheduler(engine, SchedulerConfig(layer_offload=setting != "no offload"))
        for r in warm:
            _run(sched, clock, requests([r], clock.now), costs.decode_s)
        for rate, reqs in by_rate.items():
            before = {k: getattr(sched.stats, k) for k in COUNTED}
            spent = dict(model.seconds)
            todo = requests(reqs, clock.now)
            _run(sched, clock, todo, costs.decode_s)
            out[rate] = _summary(todo, args, {k: getattr(sched.stats, k) for k in COUNTED},
                                 before, stalls)
            out[rate]["step_costs"] = sched.snapshot()["step_costs"]  # as learned by the end
            out[rate]["modeled_seconds"] = {k: round(v - spent[k], 3)
                                            for k, v in model.seconds.items()}
        if engine.cache.free_pages != engine.cache.total_pages:
            raise RuntimeError(f"{setting}: pages leaked")
    finally:
        jkv.sched.scheduler.time = real_time
        model.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--costs", default="h200-llama3-8b", choices=sorted(COSTS),
                    help="the device and model whose measured costs time the steps")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="override one of the preset's costs (a what-if: say, a cheaper "
                         "bring_layer_s); repeatable")
    ap.add_argument("--requests", type=int, default=16, help="requests per arrival rate")
    ap.add_argument("--rates", default="0.5,1", help="arrival rates, requests per second")
    ap.add_argument("--lengths", default="512,1024,2048",
                    help="prompt lengths in tokens, drawn evenly")
    ap.add_argument("--max-tokens", type=int, default=256, help="tokens decoded per request")
    ap.add_argument("--ttft-slo-ms", type=float, default=2000, help="the TTFT target")
    ap.add_argument("--tpot-slo-ms", type=float, default=25, help="the TPOT target")
    ap.add_argument("--max-model-len", type=int, default=2560, help="context length")
    ap.add_argument("--kv-cache-bytes", type=int, default=540_000_000,
                    help="the modeled device's KV pool (at the modeled model's KV size)")
    ap.add_argument("--max-num-seqs", type=int, default=32, help="sequences decoded together")
    ap.add_argument("--prefill-chunk", type=int, default=512, help="the engine's prefill chunk")
    ap.add_argument("--settings", default="no offload,offload,offload + SLO",
                    help="settings to replay, in order")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (serve_slo's)")
    ap.add_argument("--jitter", type=float, default=0.0,
                    help="each modeled step, fetch and offload times a lognormal factor of "
                         "mean 1 and this sigma (0: exact costs); a real run's steps vary")
    ap.add_argument("--jitter-seed", type=int, default=0,
                    help="seed of the jitter (each setting sees the same draws)")
    ap.add_argument("--out", default=None,
                    help="directory for the JSON (default: print only; a replay is modeled; "
                         "benchmarks/results/serve_replay holds the ones the docs quote)")
    args = ap.parse_args()
    costs = COSTS[args.costs]
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in {f.name for f in dataclasses.fields(Costs)} - {"source"}:
            ap.error(f"--set {item}: not one of the costs")
        kind = type(getattr(costs, name))
        if kind is bool and value.lower() not in ("true", "false", "1", "0"):
            ap.error(f"--set {item}: true or false")
        costs = dataclasses.replace(costs, **{name: value.lower() in ("true", "1")
                                              if kind is bool else kind(value)})
    rates = [float(r) for r in args.rates.split(",")]
    lengths = [int(m) for m in args.lengths.split(",")]
    settings = args.settings.split(",")
    engine = tiny_engine(costs, args)
    # every step shape compiled first, as the servers do (`--precompile`; a GPU's default):
    # a step that compiles is not learned, so otherwise the first setting would learn from
    # other steps than the later ones
    engine.warmup()
    warm = [{"arrival": 0.0, "prompt": r["prompt"]}  # serve_slo's warm-up
            for r in make_requests(len(lengths), 1.0, lengths, 512, args.seed + 99)]
    by_rate = {f"{rate:g}": make_requests(args.requests, rate, lengths, 512, args.seed + i)
               for i, rate in enumerate(rates)}
    rows: dict[str, dict[str, dict]] = {}
    for setting in tqdm(settings, desc="settings"):
        t0 = time.perf_counter()
        rows[setting] = replay(engine, costs, setting, warm, by_rate, args)
        tqdm.write(f"{setting}: {time.perf_counter() - t0:.0f} s on this CPU")

    def ms(v):
        return f"{v * 1000:.0f}ms"

    pool = args.kv_cache_bytes // costs.kv_bytes_per_token
    jitter = f", jitter {args.jitter:g} seed {args.jitter_seed}" if args.jitter else ""
    print(f"\nmodeled ({args.costs}; pool {pool} tokens{jitter}), not measured:")
    print(f"{'setting':<16}{'rate':>6}{'TTFT mean':>11}{'TTFT p99':>10}{'TPOT p50':>10}"
          f"{'TPOT p99':>10}{'SLO miss':>9}{'preempt':>9}{'offl lay':>9}{'adm offl':>9}"
          f"{'held':>6}{'stall':>8}")
    for setting, by_rate in rows.items():
        for rate, r in by_rate.items():
            print(f"{setting:<16}{rate:>6}{ms(r['ttft_mean_s']):>11}{ms(r['ttft_p99_s']):>10}"
                  f"{ms(r['tpot_p50_s']):>10}{ms(r['tpot_p99_s']):>10}"
                  f"{r['slo_violation_rate']:>9.0%}{r['preemptions']:>9}"
                  f"{r['layers_offloaded']:>9}{r['admitted_offloaded']:>9}"
                  f"{r['admissions_held']:>6}{ms(r['max_gap_s']):>8}")
    if args.out:
        result = {"benchmark": "serve_replay", "modeled": True, "costs": args.costs,
                  "costs_from": costs.source, "costs_values": dataclasses.asdict(costs),
                  "pool_tokens": pool, "rates": rates, "lengths": lengths, "results": rows}
        write_results(args.out, f"serve_replay-{args.costs}", result, args)


if __name__ == "__main__":
    main()
