"""Shared-layer KV in the store (`kv_sharing="krul"`) on multi-turn chats: stored bytes against
the same store without sharing (same KV format), and the next turns' fidelity.

    python benchmarks/kv_sharing_store.py [--model smollm2|shared-subspace|PATH] [--chats 4]
        [--rate 0.3] [--kv-format auto] [--max-chat-tokens 2048]

The chats are serve.py's workload (ShareGPT's turn counts and lengths), rendered with the
model's chat template. Each chat is played turn by turn through an engine and a `KVStore` (host
tier): a turn's prompt (the whole conversation so far) restores what the store holds of it,
is prefilled teacher-forced (each position's logprob and top-1 token), and its blocks are saved
again (those past the ones stored), as the server does. Once with a store that keeps entries in
the pool's format (its restores equal recomputation), once with `kv_sharing="krul"`: over every
position after a restored history, the perplexity change and the top-1 agreement; stored
bytes of both stores at the end; the store's kv_sharing counters (entries shared, groups,
bytes saved, refused); the writer's median seconds per save (the shared form is made there).

`--model shared-subspace` builds tests/shared_subspace.py's tiny model (adjacent layers share
a KV subspace, random weights) in a temporary folder: the machinery where sharing pays.
Writes benchmarks/results/kv_sharing_store/kv_sharing_store-<model>-<date>.json.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from harness import add_out_argument, write_results  # noqa: E402
from kv_sharing import PAGE, make_engine, prefill  # noqa: E402

from jkv.config import StoreConfig  # noqa: E402
from jkv.engine.saved_pages import SavedPages  # noqa: E402
from jkv.models import load_params  # noqa: E402
from jkv.models.loaders import default_model_path  # noqa: E402
from jkv.models.tokenizer import load_tokenizer  # noqa: E402
from jkv.store.store import KVStore  # noqa: E402


def chats(tokenizer, n: int, max_tokens: int, seed: int) -> list[list[int]]:
    """serve.py's conversations of two turns or more: each as the token ids where a turn
    ends (its reply's last token), the whole chat's ids last; cut at `max_tokens`."""
    from serve import make_workload

    out = []
    for conv in make_workload(8 * n, 1.0, 1.0, 0.0, seed):
        if len(conv["turns"]) < 2:
            continue
        messages, ends = [], []
        for turn in conv["turns"]:
            messages += [{"role": "user", "content": turn["user"]},
                         {"role": "assistant", "content": turn["reply"]}]
            ids = tokenizer.apply_chat_template(messages, tokenize=True)
            if len(ids) > max_tokens:
                break
            ends.append(len(ids))
        if len(ends) >= 2:
            out.append(ends + [ids[:ends[-1]]])
        if len(out) == n:
            return out
    raise SystemExit(f"serve.py's workload gave {len(out)} chats of two turns within "
                     f"{max_tokens} tokens, not {n}")


def play(engine, store: KVStore, chat: list, waits: list | None = None
         ) -> list[tuple[float, int]]:
    """Every turn of `chat` through `engine` and `store`: (logprob, top-1) of each position
    after a restored history; `waits` gets the seconds each save took the writer."""
    *ends, ids = chat
    scored = []
    for end in ends:
        prompt = ids[:end]
        hit = store.lookup(engine.cache.prompt_hashes(prompt))
        restore = None
        if hit is not None and (loaded := store.load(hit)) is not None:
            restore = SavedPages(hit.blocks, loaded.arrays, loaded.hashes,
                                 exact_blocks=loaded.exact_blocks)
        slot, cached = engine.open(prompt, restore=restore)
        lps, top1, _ = prefill(engine, slot, prompt, cached, targets=True)
        if cached:
            scored += list(zip(lps[:-1], top1[:-1], strict=True))
        approximate = store.keeps_approximate  # the blocks after those stored, as served
        start = store.tail_start(engine.saved_hashes(slot, approximate))
        saved = engine.gather(slot, start, approximate)
        t0 = time.perf_counter()
        store.save(saved.num_blocks, saved.arrays, saved.hashes, start=saved.start,
                   exact_blocks=saved.exact_blocks)
        store.flush()
        if waits is not None:
            waits.append(time.perf_counter() - t0)
        engine.close(slot, keep=False)
    return scored


def load_model(name: str, tmp: str):
    if name == "smollm2":
        path = None
    elif name == "shared-subspace":
        import shared_subspace

        path = str(shared_subspace.build(Path(tmp) / "model"))
    else:
        path = name
    cfg, params = load_params(path, jnp.float32)
    return cfg, params, load_tokenizer(path or default_model_path())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2",
                    help="smollm2 (the embedded model), shared-subspace (tests/"
                         "shared_subspace.py's tiny model) or a Hugging Face model folder")
    ap.add_argument("--chats", type=int, default=4, help="multi-turn chats played")
    ap.add_argument("--max-chat-tokens", type=int, default=2048,
                    help="a chat's turns up to this many tokens")
    ap.add_argument("--rate", type=float, default=0.3,
                    help="kv_sharing_rate: shared entries' bytes over their bf16 bytes")
    ap.add_argument("--kv-format", default="auto",
                    help="the pool's KV format, which the store without sharing keeps")
    ap.add_argument("--seed", type=int, default=0, help="serve.py workload's seed")
    add_out_argument(ap, "kv_sharing_store")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        cfg, params, tokenizer = load_model(args.model, tmp)
        convs = chats(tokenizer, args.chats, args.max_chat_tokens, args.seed)
        engine = make_engine(cfg, params, args.max_chat_tokens + 2 * PAGE, args.kv_format)
        runs = {}
        for name, sharing in (("pool format", "none"), ("krul", "krul")):
            store = KVStore(StoreConfig(host_cache_bytes=1 << 34, kv_sharing=sharing,
                                        kv_sharing_rate=args.rate),
                            model=engine.fingerprint, kv_format=engine.kv_format,
                            page_size=PAGE, convert=engine.convert_stored)
            waits: list[float] = []
            scored = [s for c in tqdm(convs, desc=name, unit="chat")
                      for s in play(engine, store, c, waits)]
            snap = store.snapshot()
            runs[name] = {"scored": scored, "bytes": snap["bytes"]["host"],
                          "writer_seconds_per_save": float(np.median(waits)),
                          "saves": snap["saves"],
                          "kv_sharing": {k: snap[f"shared_{k}"] for k in
                                         ("entries", "groups", "bytes_saved", "refused")}}
            store.close()
    base, shared = runs["pool format"], runs["krul"]
    lp0, lp1 = (np.array([s[0] for s in r["scored"]]) for r in (base, shared))
    top0, top1 = (np.array([s[1] for s in r["scored"]]) for r in (base, shared))
    summary = {"bytes_ratio": base["bytes"] / shared["bytes"],
               "perplexity_change": math.exp(-lp1.mean()) / math.exp(-lp0.mean()) - 1,
               "top1_agreement": float(np.mean(top0 == top1)), "positions": len(lp0),
               "stored_bytes": {"pool format": base["bytes"], "krul": shared["bytes"]},
               "kv_sharing": shared["kv_sharing"],
               "writer_seconds_per_save": {"pool format": base["writer_seconds_per_save"],
                                           "krul": shared["writer_seconds_per_save"]}}
    print(f"\n{args.model}, {args.kv_format} pool, {len(convs)} chats, rate {args.rate}: "
          f"stored bytes {base['bytes']:,} -> {shared['bytes']:,} "
          f"({summary['bytes_ratio']:.2f}x fewer); "
          f"over {len(lp0)} positions after restored histories: perplexity change "
          f"{100 * summary['perplexity_change']:+.2f}%, top-1 agreement "
          f"{summary['top1_agreement']:.3f}; kv_sharing {shared['kv_sharing']}; the writer's "
          f"median seconds per save {base['writer_seconds_per_save']:.3f} -> "
          f"{shared['writer_seconds_per_save']:.3f}")
    write_results(args.out, f"kv_sharing_store-{args.model.replace('/', '_')}-{args.kv_format}", {
        "benchmark": "kv_sharing_store", "device": jax.devices()[0].device_kind,
        "jax": jax.__version__, "model": args.model, "kv_format": args.kv_format,
        "rate": args.rate, "chats": len(convs),
        **summary}, args)


if __name__ == "__main__":
    main()
