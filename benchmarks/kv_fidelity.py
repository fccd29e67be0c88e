"""How much each KV policy and format keeps of SmolLM2's behaviour on long documents.

    python benchmarks/kv_fidelity.py [--doc-tokens 2048] [--configs none:bf16,leankv:1:0.02]
                                     [--docs calibration]

Three documents of this machine's Python installation (prose: CPython's license; code:
textwrap.py; a long chat: questions on standard modules answered by their docstrings, under
the model's chat template), each cut to `--doc-tokens` tokens; `--docs calibration` takes
three others of the same kinds (IDLE's NEWS2x.txt, difflib.py, other modules' docstrings),
which is where leankv's default thresholds were chosen. For every configuration
(a policy, a format and, for leankv, thresholds):
  - perplexity of each document's last 512 tokens (prompt_logprobs, prefill chunk 256, so
    earlier chunks are read from the policy's pages) and its change from the uncompressed run;
  - teacher-forced top-1 agreement with the uncompressed run over those positions;
  - free greedy agreement: 64 tokens generated after the whole document, position by
    position against the uncompressed run's, and the first position where they differ;
  - passkey retrieval at 1K, 2K and 4K tokens (a number hidden in filler text, asked for at
    the end);
  - KV bytes per token held when each request ended (`stats()["kv_bytes_per_token"]`), over
    bf16 pages' bytes.
A policy that decides at the prompt's end (snapkv) compresses nothing before it: its
perplexity and top-1 read the whole prompt, and only greedy agreement and the passkeys
measure what it dropped.
Writes benchmarks/results/kv_fidelity/kv_fidelity-<date>.json and its plot (bytes against
perplexity change: the frontier), and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import sysconfig
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from harness import add_out_argument, write_results  # noqa: E402

from jkv.config import CacheConfig, EngineConfig  # noqa: E402
from jkv.engine.engine import Engine  # noqa: E402
from jkv.engine.sampling import SamplingParams  # noqa: E402
from jkv.kv.format import KVFormat  # noqa: E402
from jkv.kv.page_pool import page_bytes  # noqa: E402
from jkv.models import load_params  # noqa: E402
from jkv.models.loaders import default_model_path  # noqa: E402
from jkv.models.tokenizer import load_tokenizer  # noqa: E402
from jkv.policies import POLICIES  # noqa: E402
from jkv.sched.scheduler import Request, Scheduler, generate_all  # noqa: E402

TAIL, NEW_TOKENS, CHUNK, PAGE = 512, 64, 256, 16
BLOCK, RESAMPLES = 32, 2000  # block bootstrap of the tails: neighbouring tokens correlate
PASSKEY_LENGTHS = (1024, 2048, 4096)
MIRRORS = (("none:k8v4t", "none:k4v8t"), ("none:k4v2t", "none:k2v4t"),
           ("leankv:5:0.001", "leankv:5:0.001:k4v8t"))  # keys finer than values, and mirrored
DEFAULT_CONFIGS = ("none:k8v4,none:k4v2,none:k8v4t,none:k4v8t,none:k4v2t,none:k2v4t,"
                   "leankv:5:0.001,leankv:3:0,leankv:10:0,leankv:5:0.001:k4v8t,"
                   "streaming:256,streaming:512,h2o:0.2,h2o:0.4,snapkv:0.2,snapkv:0.4,kivi")


def documents(tokenizer, n_tokens: int, which: str = "evaluation") -> dict[str, list[int]]:
    """Prose, code and a long chat from the Python installation, each `n_tokens` long. The
    calibration set (thresholds are chosen on it) shares no text with the evaluation set."""
    import argparse as ap
    import collections
    import csv
    import doctest
    import functools
    import heapq
    import itertools
    import json
    import re
    import string
    import typing
    import unittest

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if which == "evaluation":
        prose, code = stdlib / "LICENSE.txt", stdlib / "textwrap.py"
        modules = (re, ap, collections, functools, itertools, string)
    else:
        prose, code = stdlib / "idlelib" / "NEWS2x.txt", stdlib / "difflib.py"
        modules = (heapq, csv, json, unittest, doctest, typing)
    chat = []
    for module in modules:
        chat += [{"role": "user", "content": f"What does Python's {module.__name__} module "
                                             "offer, and how is it used?"},
                 {"role": "assistant", "content": module.__doc__.strip()}]
    docs = {"prose": tokenizer.encode(prose.read_text()),
            "code": tokenizer.encode(code.read_text()),
            "chat": tokenizer.apply_chat_template(chat, tokenize=True)}
    for name, ids in docs.items():
        if len(ids) < n_tokens:
            raise SystemExit(f"the {which} {name} document has {len(ids)} tokens, fewer than "
                             f"--doc-tokens {n_tokens}")
    return {name: ids[:n_tokens] for name, ids in docs.items()}


def passkey_prompt(tokenizer, n_tokens: int, key: int) -> list[int]:
    """Filler around one sentence that gives `key`, then the question; about n_tokens."""
    filler = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and "
              "back again. ")
    head = "There is important information hidden in the text below. Find it and remember it. "
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    question = "What is the pass key? The pass key is"
    per = len(tokenizer.encode(filler))
    reps = max(1, (n_tokens - 60) // per)
    text = head + filler * (reps // 2) + needle + filler * (reps - reps // 2) + question
    return tokenizer.encode(text)


def kv_format(name: str) -> KVFormat | str:
    """A format name, or a rotated one's name + "-unrotated" (the control without rotation)."""
    if name.endswith("-unrotated"):
        return dataclasses.replace(KVFormat.parse(name.removesuffix("-unrotated")),
                                   rotated=False)
    return name


def parse_config(text: str) -> dict:
    """none:<format>, leankv:<alpha_high>:<alpha_low>[:<format>], streaming:<window>, or
    any other policy of `jkv.policies` with its knobs' values in order (h2o:<heavy ratio>,
    kivi; window 64, model dtype); any of them may end in :<CacheConfig field>=<number>
    parts (leankv:5:0:kv_recent_window=128)."""
    parts = [p for p in text.split(":") if "=" not in p]
    extra = {}
    for p in text.split(":"):
        if "=" in p:
            key, value = p.split("=", 1)
            extra[key] = float(value) if "." in value else int(value)
    config = _parse(text, parts)
    return {**config, **extra}


def _parse(text: str, parts: list[str]) -> dict:
    name, n = parts[0], len(parts)
    if name == "none" and n == 2:
        return {"name": text, "kv_policy": "none", "kv_format": kv_format(parts[1])}
    if name == "leankv" and n in (3, 4):
        return {"name": text, "kv_policy": "leankv", "kv_alpha_high": float(parts[1]),
                "kv_alpha_low": float(parts[2]),
                "kv_format": kv_format(parts[3] if n == 4 else "k8v4t")}
    if name == "streaming" and n == 2:
        return {"name": text, "kv_policy": "streaming", "kv_recent_window": int(parts[1])}
    policy = POLICIES.get(name)
    if policy is not None and name not in ("none", "leankv", "streaming") and (
            n - 1 == len(policy.knobs)):
        knobs = zip(policy.knobs, parts[1:], strict=True)
        return {"name": text, "kv_policy": name,
                **{k: int(v) if v.isdigit() else float(v) for k, v in knobs}}
    others = ", ".join(f"{p.name}{''.join(f':<{k}>' for k in p.knobs)}" for p in
                       POLICIES.values() if p.name not in ("none", "leankv", "streaming"))
    raise SystemExit(f"--configs: {text!r} is none of none:<format>, "
                     f"leankv:<alpha_high>:<alpha_low>[:<format>], streaming:<window>, {others}")


def make_engine(cfg, params, config: dict, kv_cache_bytes: int, max_len: int) -> Engine:
    cache = CacheConfig(page_size=PAGE, kv_cache_bytes=kv_cache_bytes, **{
        k: v for k, v in config.items() if k != "name"})
    return Engine(cfg, params, cache=cache, config=EngineConfig(
        max_model_len=max_len, max_num_seqs=1, prefill_chunk=CHUNK, attention_backend="xla",
        enable_prefix_caching=False))


def run(engine: Engine, prompt: list[int], params: SamplingParams) -> Request:
    request = Request(prompt, params)
    generate_all(Scheduler(engine), [request])
    return request


def measure(engine: Engine, docs: dict, passkeys: dict) -> dict:
    """One configuration's raw outputs: per document the tail's logprobs and top-1 ids and
    the greedy continuation; passkey answers; bytes per token."""
    out = {"docs": {}, "passkey": {}}
    for name, ids in docs.items():
        r = run(engine, ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                            ignore_eos=True, prompt_logprobs=1))
        tail = r.prompt_logprobs[-TAIL:]
        out["docs"][name] = {"logprobs": [e[0] for e in tail], "top1": [e[1][0] for e in tail],
                             "greedy": list(r.output)}
    for n, (prompt, _) in passkeys.items():
        r = run(engine, prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        out["passkey"][n] = r.output
    out["bytes_per_token"] = Scheduler(engine).snapshot()["kv_bytes_per_token"]
    out["kv_tiers"] = Scheduler(engine).snapshot()["kv_tiers"]
    return out


def summarize(raw: dict, base: dict, tokenizer, keys: dict, bf16_bytes: float) -> dict:
    row = {"bytes_vs_bf16": raw["bytes_per_token"] / bf16_bytes, "docs": {}}
    changes, top1, greedy = [], [], []
    for name, d in raw["docs"].items():
        b = base["docs"][name]
        ppl, ppl_base = float(np.exp(-np.mean(d["logprobs"]))), float(np.exp(-np.mean(
            b["logprobs"])))
        same = [x == y for x, y in zip(d["greedy"], b["greedy"], strict=True)]
        doc = {"perplexity": ppl, "perplexity_change": ppl / ppl_base - 1,
               "top1_agreement": float(np.mean(np.equal(d["top1"], b["top1"]))),
               "greedy_agreement": float(np.mean(same)),
               "first_difference": same.index(False) if False in same else len(same)}
        row["docs"][name] = doc
        changes.append(doc["perplexity_change"])
        top1.append(doc["top1_agreement"])
        greedy.append(doc["greedy_agreement"])
    row["perplexity_change"] = float(np.mean(changes))
    row["top1_agreement"] = float(np.mean(top1))
    row["greedy_agreement"] = float(np.mean(greedy))
    row["passkey"] = {n: str(keys[n]) in tokenizer.decode(ids) for n, ids in
                      raw["passkey"].items()}
    row["kv_tiers"] = raw["kv_tiers"]
    return row


def bootstrap(raw: dict, base: dict, blocks: dict) -> dict[str, np.ndarray]:
    """Resampled means over the documents of the perplexity change and the top-1 agreement:
    each document's tail drawn again in blocks of BLOCK tokens (`blocks[doc]`: [RESAMPLES,
    blocks] indices, the same for every configuration, so differences are paired)."""
    def resampled(x, idx: np.ndarray) -> np.ndarray:
        return np.asarray(x, np.float64).reshape(-1, BLOCK).mean(-1)[idx].mean(-1)

    ppl, top1 = [], []
    for name, idx in blocks.items():
        d, b = raw["docs"][name], base["docs"][name]
        ppl.append(np.exp(resampled(b["logprobs"], idx) - resampled(d["logprobs"], idx)) - 1)
        top1.append(resampled(np.equal(d["top1"], b["top1"]), idx))
    return {"perplexity_change": np.mean(ppl, 0), "top1_agreement": np.mean(top1, 0)}


def interval(x: np.ndarray) -> list[float]:
    """The central 95% of bootstrap samples."""
    return [float(v) for v in np.percentile(x, [2.5, 97.5])]


def mirror_pairs(raw: dict, base: dict) -> dict:
    """For each pair of `MIRRORS` that ran: the difference (first minus second) of perplexity
    change and of top-1 agreement, with 95% block-bootstrap intervals."""
    rng = np.random.default_rng(1)
    blocks = {name: rng.integers(0, TAIL // BLOCK, (RESAMPLES, TAIL // BLOCK))
              for name in base["docs"]}
    out = {}
    for a, b in MIRRORS:
        if a not in raw or b not in raw:
            continue
        sa, sb = bootstrap(raw[a], base, blocks), bootstrap(raw[b], base, blocks)
        out[f"{a} - {b}"] = {
            metric: {"difference": float(np.mean(sa[metric] - sb[metric])),
                     "interval": interval(sa[metric] - sb[metric]),
                     "intervals": [interval(sa[metric]), interval(sb[metric])]}
            for metric in ("perplexity_change", "top1_agreement")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc-tokens", type=int, default=2048,
                    help="tokens of each document (at least 1536)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help="comma-separated none:<format>, leankv:<alpha_high>:<alpha_low>"
                         "[:<format>], streaming:<window>, h2o:<ratio>, kivi; the "
                         "uncompressed run (none:auto) always runs first")
    ap.add_argument("--docs", choices=("evaluation", "calibration"), default="evaluation",
                    help="which documents: the evaluation set, or the calibration set that "
                         "thresholds are chosen on (no text in common)")
    ap.add_argument("--passkey", default=",".join(map(str, PASSKEY_LENGTHS)),
                    help="passkey prompt lengths in tokens (empty: none)")
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 30, help="the pool's bytes")
    add_out_argument(ap, "kv_fidelity")
    args = ap.parse_args()
    if args.doc_tokens < TAIL + CHUNK:
        ap.error(f"--doc-tokens must be at least {TAIL + CHUNK}")

    path = default_model_path()
    cfg, params = load_params(None, jnp.float32)
    tokenizer = load_tokenizer(path)
    docs = documents(tokenizer, args.doc_tokens, args.docs)
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in args.passkey.split(",") if n]
    keys = {n: int(rng.integers(10000, 99999)) for n in lengths}
    passkeys = {n: (passkey_prompt(tokenizer, n, keys[n]), keys[n]) for n in lengths}
    max_len = max([args.doc_tokens] + [len(p) for p, _ in passkeys.values()]) + NEW_TOKENS + 16
    bf16_bytes = (page_bytes(KVFormat(), PAGE, cfg.head_dim, jnp.bfloat16) / PAGE
                  * cfg.num_layers * cfg.num_kv_heads)

    configs = [parse_config("none:auto")] + [parse_config(c) for c in args.configs.split(",")]
    raw = {}
    for config in tqdm(configs, desc="configurations", unit="config"):
        engine = make_engine(cfg, params, config, args.kv_cache_bytes, max_len)
        raw[config["name"]] = measure(engine, docs, passkeys)
    base = raw["none:auto"]
    rows = {name: summarize(r, base, tokenizer, keys, bf16_bytes) for name, r in raw.items()}

    print(f"\n| config | bytes/bf16 | ppl change | top-1 | greedy | passkey "
          f"{'/'.join(map(str, lengths))} |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        pk = "/".join("y" if r["passkey"][n] else "n" for n in lengths)
        print(f"| {name} | {r['bytes_vs_bf16']:.3f} | {100 * r['perplexity_change']:+.2f}% | "
              f"{r['top1_agreement']:.3f} | {r['greedy_agreement']:.3f} | {pk} |")
    pairs = mirror_pairs(raw, base)
    if pairs:
        print("\n| pair (first - second) | ppl change difference [95%] | top-1 difference [95%] |")
        print("|---|---|---|")
    for pair, m in pairs.items():
        p, t = m["perplexity_change"], m["top1_agreement"]
        print(f"| {pair} | {100 * p['difference']:+.2f}% [{100 * p['interval'][0]:+.2f}, "
              f"{100 * p['interval'][1]:+.2f}] | {t['difference']:+.3f} [{t['interval'][0]:+.3f}, "
              f"{t['interval'][1]:+.3f}] |")
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "documents": args.docs, "doc_tokens": {k: len(v) for k, v in docs.items()},
              "tail": TAIL, "chunk": CHUNK, "new_tokens": NEW_TOKENS, "passkeys": keys,
              "rows": rows, "mirror_pairs": pairs}
    write_results(args.out, "kv_fidelity", result, args)


if __name__ == "__main__":
    main()
