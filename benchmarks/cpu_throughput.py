"""Prefill time and decode rate of jkv against transformers on this CPU, side by side in one run.

    python benchmarks/cpu_throughput.py [--lengths 512,2048,4096] [--repeats 3]
                                        [--new-tokens 64] [--decode-prompt-tokens 128]
                                        [--batch 4] [--out DIR]

Both run SmolLM2-135M-Instruct (the embedded default, GGUF dequantized to float32) greedily on
the same token ids. Prefill: the wall time of one prompt of each length up to its first
generated token (jkv: `LLM.generate` with max_model_len=8192, prefix caching and the KV store
off, every shape compiled before timing; transformers: `generate` of 1 new token, torch's
default number of threads). Decode: single-stream tokens/s after a short prompt, N new tokens
over the time of 1 + N tokens minus the time of 1. The two engines are timed alternately
(which goes first alternates too), and each figure is the median of --repeats runs; the ratio
is jkv's speed over transformers' (above 1: jkv is faster). With --batch N, jkv's decode
throughput with N streams at once is measured too. Writes
benchmarks/results/cpu_throughput/cpu_throughput-<date>.json (-2, -3, ... for later runs
that day; the CPU's model as `lscpu` names it is in the JSON) and its plot. XLA_FLAGS is
recorded too: on a part where jkv is the slower, compare runs under candidates such as
`XLA_FLAGS=--xla_cpu_use_onednn=true`, `--xla_cpu_use_xnnpack=true` or
`--xla_cpu_prefer_vector_width=512` (on the AMD EPYC of the committed runs none of them moved
the 2K prefill beyond run-to-run noise).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import add_out_argument, cpu_model, write_results  # noqa: E402

from jkv import LLM, SamplingParams  # noqa: E402
from jkv.models.loaders import default_model_path  # noqa: E402

TEXT = (
    "Inference engines keep the keys and values of every past token so that each new token "
    "costs one pass over the weights instead of a pass over the whole history. That cache "
    "grows with the conversation, and deciding where it lives, how precisely it is stored and "
    "when it is brought back is most of the work of serving long chats efficiently. "
)
MAX_MODEL_LEN = 8192
PAUSE_S = 0.5  # between the engines' runs, so one's worker threads are idle for the other


def prompt_ids(tokenizer, length: int, offset: int = 0) -> list[int]:
    """`length` token ids of the repeated TEXT, starting `offset` tokens in."""
    ids = tokenizer.encode(TEXT * (2 + (length + offset) // 40), add_special_tokens=False)
    if len(ids) < length + offset:
        raise ValueError(f"the text gives {len(ids)} tokens, {length + offset} asked for")
    return ids[offset: offset + length]


class Transformers:
    """transformers' `generate`, greedy, EOS not special."""

    name = "transformers"

    def __init__(self) -> None:
        import torch
        import transformers

        path = default_model_path()
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        self.versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                         "torch_threads": torch.get_num_threads()}

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        x = self.torch.tensor(prompts)
        t0 = time.perf_counter()
        with self.torch.no_grad():
            out = self.model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)
        seconds = time.perf_counter() - t0
        return seconds, out[:, x.shape[1]:].tolist()


class Jkv:
    """jkv's offline `LLM.generate`, greedy, EOS ignored."""

    name = "jkv"

    def __init__(self, max_num_seqs: int) -> None:
        self.llm = LLM(dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=max_num_seqs,
                       enable_prefix_caching=False, host_cache_bytes=0)
        self.tokenizer = self.llm.tokenizer
        self.versions = {"attention_backend": self.llm.engine.attention_backend}

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        sp = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, sp)
        seconds = time.perf_counter() - t0
        return seconds, [o.token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--lengths", default="512,2048,4096",
                    help="prompt lengths in tokens whose prefill time is measured, comma "
                         f"separated (each below {MAX_MODEL_LEN})")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs per figure and engine; the median is reported")
    ap.add_argument("--new-tokens", type=int, default=64,
                    help="tokens generated for the decode rates")
    ap.add_argument("--decode-prompt-tokens", type=int, default=128,
                    help="prompt length before the decode rates are measured")
    ap.add_argument("--batch", type=int, default=4,
                    help="also measure jkv's decode throughput with this many streams at once "
                         "(0 or 1: skip)")
    add_out_argument(ap, "cpu_throughput")
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",") if n]
    if not lengths or min(lengths) < 1 or max(lengths) >= MAX_MODEL_LEN:
        ap.error(f"--lengths must be in [1, {MAX_MODEL_LEN}), got {args.lengths!r}")
    if args.repeats < 1 or args.new_tokens < 1 or args.decode_prompt_tokens < 1:
        ap.error("--repeats, --new-tokens and --decode-prompt-tokens must be positive")

    jkv = Jkv(max(args.batch, 1))
    hf = Transformers()
    engines = [jkv, hf]
    tok = jkv.tokenizer
    decode_prompt = prompt_ids(tok, args.decode_prompt_tokens)
    batch_prompts = [prompt_ids(tok, args.decode_prompt_tokens, 7 * i) for i in range(args.batch)]

    # (label, engines, prompts, new tokens): runs whose times the figures are made of
    runs = [(f"prefill {n}", engines, [prompt_ids(tok, n)], 1) for n in lengths]
    runs += [("decode 1", engines, [decode_prompt], 1),
             ("decode 1+n", engines, [decode_prompt], 1 + args.new_tokens)]
    if args.batch > 1:
        runs += [(f"batch {args.batch} 1", [jkv], batch_prompts, 1),
                 (f"batch {args.batch} 1+n", [jkv], batch_prompts, 1 + args.new_tokens)]

    times: dict[str, dict[str, list[float]]] = {r[0]: {e.name: [] for e in r[1]} for r in runs}
    tokens: dict[str, dict[str, list[list[int]]]] = {r[0]: {} for r in runs}
    total = sum(len(r[1]) for r in runs) * (args.repeats + 1)
    with tqdm(total=total, desc="timing", unit="run") as bar:
        for repeat in range(args.repeats + 1):  # repeat 0 warms up (compiles every shape)
            for label, run_engines, prompts, new in runs:
                order = run_engines if repeat % 2 else run_engines[::-1]
                for engine in order:
                    bar.set_postfix_str(f"{engine.name}: {label}")
                    time.sleep(PAUSE_S)
                    seconds, out = engine.run(prompts, new)
                    if repeat:
                        times[label][engine.name].append(seconds)
                    tokens[label][engine.name] = out
                    bar.update()

    def median(label: str, name: str) -> float:
        return statistics.median(times[label][name])

    rows = []
    for n in lengths:
        label = f"prefill {n}"
        j, h = median(label, "jkv"), median(label, "transformers")
        rows.append({"row": f"prefill {n} tokens (s)", "jkv": j, "transformers": h,
                     "speed_ratio": h / j,
                     "same_first_token": tokens[label]["jkv"] == tokens[label]["transformers"]})

    def rate(name: str, label: str, streams: int) -> float:
        """Decode tokens/s from the medians of the 1-token and 1+n-token runs."""
        return streams * args.new_tokens / (median(f"{label} 1+n", name)
                                            - median(f"{label} 1", name))

    j, h = rate("jkv", "decode", 1), rate("transformers", "decode", 1)
    same = tokens["decode 1+n"]["jkv"] == tokens["decode 1+n"]["transformers"]
    rows.append({"row": "decode, 1 stream (tok/s)", "jkv": j, "transformers": h,
                 "speed_ratio": j / h, "same_tokens": same})
    if args.batch > 1:
        j = rate("jkv", f"batch {args.batch}", args.batch)
        rows.append({"row": f"decode, {args.batch} streams (tok/s)", "jkv": j,
                     "transformers": None, "speed_ratio": j / h,
                     "note": "ratio against transformers' single stream"})

    device = jax.devices()[0].device_kind
    print(f"\nSmolLM2-135M float32, greedy, on {cpu_model()} ({os.cpu_count()} cores, jax "
          f"device {device}); jax {jax.__version__}, torch {hf.versions['torch']} "
          f"({hf.versions['torch_threads']} threads); median of {args.repeats} runs")
    print(f"{'':<28}{'jkv':>10}{'transformers':>14}{'jkv/transformers':>18}")
    for r in rows:
        hf_text = "-" if r["transformers"] is None else f"{r['transformers']:.2f}"
        print(f"{r['row']:<28}{r['jkv']:>10.2f}{hf_text:>14}{r['speed_ratio']:>17.2f}x")
    print("(jkv/transformers: jkv's speed over transformers'; above 1, jkv is faster)")

    result = {"numpy": np.__version__, **hf.versions, **jkv.versions,
              "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "max_model_len": MAX_MODEL_LEN, "rows": rows, "times_s": times}
    write_results(args.out, "cpu_throughput", result, args)


if __name__ == "__main__":
    main()
