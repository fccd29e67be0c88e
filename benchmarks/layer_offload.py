"""What LayerKV's layer-wise offload costs: a prompt prefilled with some of its layers held on
the host (each brought through the pool for its layer's turn) against the same prompt with
every layer resident, decode steps with offloaded layers against resident ones, and the time
to fetch offloaded layers back, side by side in one run on the same inputs.

    python benchmarks/layer_offload.py                       # SmolLM2 (embedded), CPU
    python benchmarks/layer_offload.py --preset llama3-8b --lengths 2048,8192   # GPU

For each prompt length and each resident-layer count (`--resident`; the model's layer count
is all resident) one engine prefills the prompt in `--prefill-chunk` chunks (offloaded runs
also layer-major, as the scheduler feeds a long prompt admitted with layers on the host:
each step a chunk's worth of layers over the whole prompt, `jkv.engine.layer_major`), decodes
`--decode-steps` tokens with a batch of one, and (offloaded runs) fetches the layers back and
decodes as many again. Each run is repeated (`--repeats`, after one untimed run that
compiles); medians are reported, with each offloaded run's ratio to the resident one, and
the caller's seconds per decode step inside the copies' calls (bring, send, settle: a copy
that holds the caller shows there). Offloaded layers are brought from pinned host memory
where the backend has it; `--compare-pageable` runs each offloaded setting again bringing
them from their numpy copies. With `--trace DIR`, the longest prompt's decode steps with the
fewest resident layers are traced once more with `jax.profiler` (not timed), for
`benchmarks/trace_ops.py`: which XLA modules (the layer step, bring_layer, drop_layers,
copy_layer_out) take a decode step's time, and how much of it no device op covers.
Writes benchmarks/results/layer_offload/layer_offload-<device>-<date>.json and its plot.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from harness import add_out_argument, write_results
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_model import add_model_args, load_model, result_stem  # noqa: E402

from jkv.config import CacheConfig, EngineConfig  # noqa: E402
from jkv.engine.engine import Engine, Row  # noqa: E402
from jkv.engine.layer_major import layers_for  # noqa: E402
from jkv.engine.sampling import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0)


def prefill_layer_major(eng: Engine, prompt: list[int], resident: int, chunk: int) -> float:
    """Seconds to prefill `prompt` layer-major with `resident` layers in the pool, as the
    scheduler feeds it (each step a chunk's worth of layers over the whole prompt)."""
    key, num_layers = eng.request_key(0), eng.cfg.num_layers
    t0 = time.perf_counter()
    slot, pos = eng.open(prompt, use_prefix_cache=False, resident=resident)
    done = 0
    while done < num_layers:
        k = layers_for(chunk, len(prompt) - pos, num_layers, done)
        (s,), _ = eng.step([Row(slot, prompt[pos:], GREEDY, key, layer_span=(done, done + k))], [])
        done += k
    seconds = time.perf_counter() - t0  # (the first token read back: the work is done)
    eng.close(slot, keep=False)
    return seconds


def one_run(eng: Engine, prompt: list[int], resident: int | None, steps: int,
            chunk: int) -> dict[str, float]:
    """Seconds: the prefill, a decode step (mean of `steps`), and with offloaded layers the
    prefill fed layer-major, the fetch and a decode step after it."""
    key = eng.request_key(0)
    out = {}
    if resident is not None and len(prompt) > chunk:
        out["prefill_layer_major"] = prefill_layer_major(eng, prompt, resident, chunk)
    t0 = time.perf_counter()
    slot, pos = eng.open(prompt, use_prefix_cache=False, resident=resident)
    while pos < len(prompt):
        (s,), _ = eng.step([Row(slot, prompt[pos:pos + chunk], GREEDY, key)], [])
        pos += chunk
    out["prefill"] = time.perf_counter() - t0
    token = s.token

    def decode(n: int) -> float:
        nonlocal token
        t = time.perf_counter()
        for i in range(n):
            _, (d,) = eng.step([], [Row(slot, [token], GREEDY, key, i + 1)])
            token = d.token
        return (time.perf_counter() - t) / n

    before = dict(eng.layers.host_seconds)
    out["decode_step"] = decode(steps)
    for k, v in eng.layers.host_seconds.items():  # the caller's time in the copies' calls
        out[f"decode_{k}_host"] = (v - before[k]) / steps
    if eng.offloaded_layers(slot):
        t0 = time.perf_counter()
        eng.fetch_layers(slot)
        jax.block_until_ready(eng.cache.pool)
        out["fetch"] = time.perf_counter() - t0
        out["decode_step_fetched"] = decode(steps)
    eng.close(slot, keep=False)
    return out


def trace_decode(eng: Engine, prompt: list[int], resident: int | None, steps: int,
                 chunk: int, trace: Path) -> None:
    """Prefill `prompt` with `resident` layers in the pool, then trace `steps` decode steps
    (after two untraced ones) into `trace` (perfetto, for trace_ops.py)."""
    key = eng.request_key(0)
    slot, pos = eng.open(prompt, use_prefix_cache=False, resident=resident)
    while pos < len(prompt):
        (s,), _ = eng.step([Row(slot, prompt[pos:pos + chunk], GREEDY, key)], [])
        pos += chunk
    token = s.token
    for i in range(steps + 2):
        if i == 2:
            jax.block_until_ready(eng.cache.pool)
            jax.profiler.start_trace(str(trace), create_perfetto_trace=True)
        _, (d,) = eng.step([], [Row(slot, [token], GREEDY, key, i + 1)])
        token = d.token
    jax.block_until_ready(eng.cache.pool)
    jax.profiler.stop_trace()
    eng.close(slot, keep=False)
    print(f"traced {steps} decode steps of {len(prompt)} tokens with {resident} resident "
          f"layers into {trace}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--lengths", default="1024,4096", help="prompt lengths in tokens")
    ap.add_argument("--resident", default="0,10",
                    help="resident layer counts to compare with all layers resident")
    ap.add_argument("--prefill-chunk", type=int, default=512, help="engine prefill chunk")
    ap.add_argument("--decode-steps", type=int, default=8, help="decode steps timed per run")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per setting")
    ap.add_argument("--compare-pageable", action="store_true",
                    help="also run each offloaded setting bringing layers from their numpy "
                         "copies instead of pinned host memory")
    ap.add_argument("--trace", default=None,
                    help="write a jax.profiler trace (perfetto) of the longest prompt's decode "
                         "steps with the fewest resident layers to this directory, after the "
                         "timed runs (for benchmarks/trace_ops.py)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    add_out_argument(ap, "layer_offload")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    max_len = max(lengths) + 2 * args.decode_steps + 16
    cfg, params, dtype, _, name = load_model(args)
    # random weights time any length the same; real ones stay within their context
    if args.preset:
        cfg = cfg.replace(max_position_embeddings=max(cfg.max_position_embeddings, max_len))
    settings = [(None, True)] + [(int(x), pinned) for x in args.resident.split(",")
                                 if int(x) < cfg.num_layers
                                 for pinned in ((True, False) if args.compare_pageable
                                                else (True,))]
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize
    eng = Engine(cfg, params, cache=CacheConfig(page_size=16, kv_cache_bytes=int(
                     1.25 * max_len * per_token)),
                 config=EngineConfig(max_model_len=max_len, max_num_seqs=1,
                                     prefill_chunk=args.prefill_chunk,
                                     attention_backend=args.attention_backend,
                                     enable_prefix_caching=False))
    staging = eng.layers.staging
    if staging is None:
        print("no pinned host memory on this backend: brings copy from numpy arrays")
    rng = np.random.default_rng(args.seed)
    rows = []
    for length in tqdm(lengths, desc="prompt lengths"):
        prompt = rng.integers(0, cfg.vocab_size, length).tolist()
        base = None
        for resident, pinned in settings:
            eng.layers.staging = staging if pinned else None
            one_run(eng, prompt, resident, 2, args.prefill_chunk)  # compiles
            runs = [one_run(eng, prompt, resident, args.decode_steps, args.prefill_chunk)
                    for _ in range(args.repeats)]
            row = {"length": length, "resident": cfg.num_layers if resident is None
                   else resident, "pinned": pinned and staging is not None,
                   **{k: float(np.median([r[k] for r in runs])) for k in runs[0]}}
            base = base or row
            row["prefill_vs_resident"] = row["prefill"] / base["prefill"]
            if "prefill_layer_major" in row:
                row["layer_major_vs_resident"] = row["prefill_layer_major"] / base["prefill"]
            row["decode_vs_resident"] = row["decode_step"] / base["decode_step"]
            rows.append(row)
    if args.trace is not None:
        fewest = min((r for r, _ in settings if r is not None), default=None)
        prompt = rng.integers(0, cfg.vocab_size, max(lengths)).tolist()
        eng.layers.staging = staging
        trace_decode(eng, prompt, fewest, args.decode_steps, args.prefill_chunk,
                     Path(args.trace))
    print(f"\n{'tokens':>7}{'resident':>9}{'pinned':>7}{'prefill':>10}{'ratio':>7}"
          f"{'layer-major':>12}{'ratio':>7}"
          f"{'decode':>9}{'ratio':>7}{'bring':>8}{'send':>8}{'settle':>8}{'fetch':>9}"
          f"{'decode after':>14}")
    for r in rows:
        major = (f"{r['prefill_layer_major'] * 1000:>10.0f}ms{r['layer_major_vs_resident']:>7.2f}"
                 if "prefill_layer_major" in r else f"{'-':>12}{'-':>7}")
        fetch = f"{r['fetch'] * 1000:.0f}ms" if "fetch" in r else "-"
        after = (f"{r['decode_step_fetched'] * 1000:.1f}ms" if "decode_step_fetched" in r
                 else "-")
        host = "".join(f"{r[f'decode_{k}_host'] * 1000:>6.1f}ms"
                       for k in ("bring", "send", "settle"))
        print(f"{r['length']:>7}{r['resident']:>9}{'yes' if r['pinned'] else 'no':>7}"
              f"{r['prefill'] * 1000:>8.0f}ms{r['prefill_vs_resident']:>7.2f}{major}"
              f"{r['decode_step'] * 1000:>7.1f}ms{r['decode_vs_resident']:>7.2f}{host}"
              f"{fetch:>9}{after:>14}")
    write_results(args.out, result_stem("layer_offload", args),
                  {"benchmark": "layer_offload", "device": jax.devices()[0].device_kind,
                   "jax": jax.__version__, "model": name, "layers": cfg.num_layers,
                   "rows": rows}, args)


if __name__ == "__main__":
    main()
