"""Two replicas writing one shared KV store at once, one of them killed with SIGKILL at random
moments: every entry read back verifies, every restore equals a recompute.

    python benchmarks/shared_store_faults.py --minutes 5        # the acceptance run
    python benchmarks/shared_store_faults.py --minutes 0.5      # a quick look

The driver starts tensorstore's OCDBT coordinator and two writer processes on one store
directory (`StoreConfig.store_coordinator`). Each writer serves multi-turn chats of one
random-weight model (the same seed in both, greedy, so a chat's history is the same wherever
it runs) through the serving loop with its own host tier and the shared one: it picks one of
`--chats` chats at random and runs its next turn; its turn counters are its own, so the other
writer's entries of a chat's earlier turns are restored (`prefix_hit_tokens` by tier), and a
writer restarted after a kill starts every chat from its first turn again. Each turn is
checked against a store-less loop of the same model (restore == recompute) and reported as a
line. Writer 1 is SIGKILLed every `--kill-every` seconds on average (exponential) and
restarted at once. At the end every entry the store indexes is read back through a fresh
store (its checksum and block hashes verified) and the counts are printed and written to
benchmarks/results/shared_store_faults/shared_store_faults-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import add_out_argument, write_results

MODEL = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_layers": 2,
         "num_heads": 4, "num_kv_heads": 2, "head_dim": 32, "rope_theta": 10000.0}
ENGINE = {"max_model_len": 512, "max_num_seqs": 2, "prefill_chunk": 64,
          "enable_prefix_caching": False}
PAGE, POOL_BYTES, TURNS, NEW_TOKENS = 8, 8_000_000, 5, 6


def parts(store_dir: str | None, coordinator: str | None):
    """The model's engine config and, with a store, the store of one writer."""
    import jax.numpy as jnp

    from jkv.config import CacheConfig, EngineConfig, ModelConfig, StoreConfig
    from jkv.engine.engine import Engine
    from jkv.models.loaders import random_params
    from jkv.store.store import KVStore

    cfg = ModelConfig(**MODEL)
    eng = Engine(cfg, random_params(cfg, seed=11, dtype=jnp.float32),
                 cache=CacheConfig(page_size=PAGE, kv_cache_bytes=POOL_BYTES),
                 config=EngineConfig(**ENGINE))
    store = None if store_dir is None else KVStore(
        StoreConfig(host_cache_bytes=1 << 22, store_dir=store_dir,
                    store_coordinator=coordinator, disk_cache_bytes=1 << 30),
        model=eng.fingerprint, kv_format=eng.kv_format, page_size=eng.page_size)
    return eng, store


def chat_turn(chat: int, turn: int, outputs: list[list[int]]) -> list[int]:
    """The prompt of `chat`'s turn `turn` given the earlier turns' outputs: each user turn's
    tokens drawn from the chat's own seed, so every writer builds the same history."""
    rng = random.Random(chat)
    prompt = []
    for t in range(turn + 1):
        prompt += [rng.randrange(512) for _ in range(rng.randrange(20, 60))]
        if t < turn:
            prompt += outputs[t]
    return prompt


def writer(store_dir: str, coordinator: str, chats: int, seed: int) -> None:
    """A writer process: chats' turns until killed, one JSON line per turn."""
    from jkv.engine.sampling import SamplingParams
    from jkv.sched.scheduler import Request, Scheduler, generate_all

    eng, store = parts(store_dir, coordinator)
    served, alone = Scheduler(eng, store=store), Scheduler(parts(None, None)[0])
    rng, outputs = random.Random(seed), {c: [] for c in range(chats)}
    while True:
        chat = rng.randrange(chats)
        if len(outputs[chat]) == TURNS:
            outputs[chat] = []
        prompt = chat_turn(chat, len(outputs[chat]), outputs[chat])
        store.refresh()
        before = dict(served.snapshot()["prefix_hit_tokens"])
        got, want = (Request(list(prompt), SamplingParams(max_tokens=NEW_TOKENS,
                                                          temperature=0)) for _ in range(2))
        generate_all(served, [got])
        generate_all(alone, [want])
        hits = served.snapshot()["prefix_hit_tokens"]
        print(json.dumps({"chat": chat, "turn": len(outputs[chat]), "prompt": len(prompt),
                          "restored": {t: hits[t] - before.get(t, 0) for t in hits},
                          "equal": got.output == want.output}), flush=True)
        outputs[chat].append(want.output)


def verify(store_dir: str, coordinator: str) -> dict:
    """Read back every entry the store indexes, along its chain, through a fresh store."""
    _, store = parts(store_dir, coordinator)
    index, read, missed = store.index, 0, 0
    for key in list(index.entries):
        hashes = [h for k in index.chain(key) for h in index.entries[k].hashes]
        hit = store.lookup(hashes)
        if hit is not None and hit.blocks == len(hashes) and store.load(hit) is not None:
            read += 1
        else:
            missed += 1
    snap = store.snapshot()
    store.close()
    return {"entries": len(index.entries), "read_back": read, "missed": missed,
            "corrupt": snap["corrupt_entries"], "read_failures": snap["read_failures"]}


def start_writer(args, store_dir: str, coordinator: str, log: Path, seed: int):
    """A writer process; its programs compiled once into a cache beside the logs (a writer
    restarted after a kill reads them back instead of compiling them again)."""
    cmd = [sys.executable, __file__, "--writer", store_dir, coordinator, str(args.chats),
           str(seed)]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=str(log.parent / "xla"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               XLA_FLAGS="--xla_backend_optimization_level=0")
    with open(log, "a") as out, open(log.with_suffix(".err"), "a") as err:
        return subprocess.Popen(cmd, stdout=out, stderr=err, env=env)


def run(args) -> dict:
    import tensorstore as ts

    server = ts.ocdbt.DistributedCoordinatorServer({"bind_addresses": ["127.0.0.1:0"]})
    coordinator = f"127.0.0.1:{server.port}"
    tmp = Path(tempfile.mkdtemp(prefix="jkv-shared-store-"))
    store_dir, logs = str(tmp / "store"), [tmp / "w0.jsonl", tmp / "w1.jsonl"]
    rng = random.Random(args.seed)
    procs = [start_writer(args, store_dir, coordinator, logs[i], rng.randrange(1 << 30))
             for i in range(2)]
    kills, deadline = 0, time.monotonic() + args.minutes * 60
    try:
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, rng.expovariate(1 / args.kill_every)))
            if time.monotonic() < deadline:
                procs[1].send_signal(signal.SIGKILL)
                procs[1].wait()
                kills += 1
                procs[1] = start_writer(args, store_dir, coordinator, logs[1],
                                        rng.randrange(1 << 30))
                print(f"{time.monotonic() - deadline + args.minutes * 60:7.1f} s: "
                      f"writer 1 killed ({kills})", flush=True)
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
    turns = [json.loads(x) for log in logs for x in log.read_text().splitlines()
             if x.startswith("{")]
    per_writer = [len(log.read_text().splitlines()) for log in logs]
    store = verify(store_dir, coordinator)
    shutil.rmtree(tmp, ignore_errors=True)  # (the store, the logs and the compilations)
    return {"kills": kills, "turns": len(turns),
            "turns_per_writer": per_writer,
            "turns_restored": sum(any(t["restored"].get(k, 0) for k in ("host", "disk"))
                                  for t in turns),
            "restored_tokens": {k: sum(t["restored"].get(k, 0) for t in turns)
                                for k in ("host", "disk")},
            "turns_not_equal": sum(not t["equal"] for t in turns),
            "store": store}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--writer":
        writer(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0, help="how long the writers run")
    ap.add_argument("--kill-every", type=float, default=10.0,
                    help="mean seconds between SIGKILLs of writer 1 (exponential)")
    ap.add_argument("--chats", type=int, default=12, help="chats the writers share")
    ap.add_argument("--seed", type=int, default=0)
    add_out_argument(ap, "shared_store_faults")
    args = ap.parse_args()
    result = run(args)
    s = result["store"]
    print(f"{result['kills']} kills, {result['turns']} turns "
          f"({result['turns_restored']} restored: {result['restored_tokens']}), "
          f"{result['turns_not_equal']} not equal to a recompute; store: {s['entries']} "
          f"entries, {s['read_back']} read back whole, {s['missed']} missed, "
          f"{s['corrupt']} corrupt")
    write_results(args.out, "shared_store_faults", result, args)


if __name__ == "__main__":
    main()
