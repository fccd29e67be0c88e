"""Where a host-tier restore's time goes: one history length, the load (lookup, checksum,
decode, the page writes with their host-to-device copies) timed and then profiled by
cProfile, sorted by each function's own time.

    python benchmarks/restore_profile.py --preset llama3-8b --length 16384   # GPU
    python benchmarks/restore_profile.py --preset smollm2-135m --length 2048

Companion to restore.py, which times the load against recompute; this says which part of
the load to make faster next.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np
from restore import load_run, prefill, restore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jkv.config import PRESETS, CacheConfig, EngineConfig, StoreConfig  # noqa: E402
from jkv.engine.engine import Engine  # noqa: E402
from jkv.models.loaders import random_params  # noqa: E402
from jkv.store.store import KVStore  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--preset", default="smollm2-135m", choices=sorted(PRESETS),
                    help="random weights of this model shape")
    ap.add_argument("--length", type=int, default=4096, help="history tokens")
    ap.add_argument("--new-tokens", type=int, default=84, help="tokens of the follow-up")
    ap.add_argument("--repeats", type=int, default=3, help="timed loads before profiling")
    ap.add_argument("--top", type=int, default=14, help="functions listed by own time")
    args = ap.parse_args()
    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    max_len = args.length + args.new_tokens + 16
    cfg = PRESETS[args.preset]
    cfg = cfg.replace(max_position_embeddings=max(cfg.max_position_embeddings, max_len))
    params = random_params(cfg, 0, dtype)
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize

    def make_engine(**kw) -> Engine:
        return Engine(cfg, params, cache=CacheConfig(
            page_size=16, kv_cache_bytes=max(2_000_000_000, int(2.5 * max_len * per_token))),
            config=EngineConfig(max_model_len=max_len, max_num_seqs=2, prefill_chunk=512, **kw))

    rng = np.random.default_rng(0)
    history = rng.integers(0, cfg.vocab_size, args.length).tolist()
    follow_up = history + rng.integers(0, cfg.vocab_size, args.new_tokens).tolist()
    saver = make_engine()
    slot, cached = saver.open(history)
    prefill(saver, slot, history, cached)
    saved = saver.gather(slot)
    del saver
    eng = make_engine(enable_prefix_caching=False)
    store = KVStore(StoreConfig(host_cache_bytes=2**36), model=eng.fingerprint,
                    kv_format=eng.kv_format, page_size=16)
    store.save(saved.num_blocks, saved.arrays, saved.hashes)
    store.flush()
    del saved
    nbytes = store.snapshot()["bytes"]["host"]
    print(f"{args.preset}, {args.length}-token history, {nbytes / 1e6:.1f} MB entry, "
          f"{jax.devices()[0].device_kind}")
    for _ in range(args.repeats):  # the first includes compiles
        ms, _ = load_run(eng, store, follow_up)
        print(f"load {ms:.1f} ms = {nbytes / ms / 1e6:.2f} GB/s")
    t0 = time.perf_counter()
    store.load(store.lookup(eng.cache.prompt_hashes(follow_up)))
    ms = 1e3 * (time.perf_counter() - t0)
    print(f"of which the store's lookup and load (checksum, decode): {ms:.1f} ms")
    profile = cProfile.Profile()
    for _ in range(2):  # the load alone: no prefill after it
        profile.enable()
        slot, _ = restore(eng, store, follow_up)
        profile.disable()
        eng.close(slot)
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
