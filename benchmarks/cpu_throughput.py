"""Prefill and decode tokens/s of jkv against transformers generate, same prompts, same machine.

    python benchmarks/cpu_throughput.py [--new-tokens 64] [--prompt-tokens 128] [--prompts 4]

Both run SmolLM2-135M-Instruct (the embedded default, GGUF dequantized to float32) greedily.
Prefill time is the time to the first token; decode rate is the remaining tokens over the
remaining time. Writes benchmarks/results/cpu_throughput-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from jkv import LLM, SamplingParams  # noqa: E402
from jkv.models.loaders import default_model_path  # noqa: E402

TEXT = (
    "Inference engines keep the keys and values of every past token so that each new token "
    "costs one pass over the weights instead of a pass over the whole history. That cache "
    "grows with the conversation, and deciding where it lives, how precisely it is stored and "
    "when it is brought back is most of the work of serving long chats efficiently. "
)


def prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    ids = tokenizer.encode(TEXT * (1 + 2 * length // 40), add_special_tokens=False)
    return [ids[i * 7: i * 7 + length] for i in range(n)]


def bench_transformers(ids_list, new_tokens: int) -> dict:
    import torch
    import transformers

    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32).eval()
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def gen(ids, n):
        x = torch.tensor([ids])
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
        return time.perf_counter() - t, out.shape[1] - len(ids)

    gen(ids_list[0], 4)  # warm-up
    prefill_s = decode_s = 0.0
    prefill_tok = decode_tok = 0
    for ids in tqdm(ids_list, desc="transformers", leave=False):
        t1, _ = gen(ids, 1)
        tn, n = gen(ids, new_tokens)
        prefill_s, prefill_tok = prefill_s + t1, prefill_tok + len(ids)
        decode_s, decode_tok = decode_s + (tn - t1), decode_tok + n - 1
    return {"prefill_tok_s": prefill_tok / prefill_s, "decode_tok_s": decode_tok / decode_s,
            "torch": torch.__version__, "transformers": transformers.__version__}


def bench_jkv(llm: LLM, ids_list, new_tokens: int, batch: int) -> dict:
    sp = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate(ids_list[:batch], sp)  # warm-up: compiles every shape bucket used below
    llm.engine.stats.__init__()
    for i in tqdm(range(0, len(ids_list), batch), desc=f"jkv batch {batch}", leave=False):
        llm.generate(ids_list[i: i + batch], sp)
    s = llm.engine.stats
    return {"prefill_tok_s": s.prefill_tokens / s.prefill_seconds,
            "decode_tok_s": s.decode_tokens / s.decode_seconds,
            "compiled_shapes": len(s.step_shapes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="tokens per prompt")
    ap.add_argument("--prompts", type=int, default=4, help="number of prompts")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"),
                    help="directory for the JSON result")
    args = ap.parse_args()

    llm = LLM(dtype="float32", max_model_len=1024, max_num_seqs=args.prompts)
    ids_list = prompts(llm.tokenizer, args.prompts, args.prompt_tokens)
    rows = {
        "transformers (batch 1)": bench_transformers(ids_list, args.new_tokens),
        "jkv (batch 1)": bench_jkv(llm, ids_list, args.new_tokens, 1),
        f"jkv (batch {args.prompts})": bench_jkv(llm, ids_list, args.new_tokens, args.prompts),
    }
    base = rows["transformers (batch 1)"]
    print(f"\nSmolLM2-135M float32, {args.prompts} prompts x {args.prompt_tokens} tokens, "
          f"{args.new_tokens} new tokens, greedy, on {jax.devices()[0].device_kind}")
    print(f"{'engine':<24}{'prefill tok/s':>15}{'decode tok/s':>15}{'decode vs HF':>14}")
    for name, r in rows.items():
        print(f"{name:<24}{r['prefill_tok_s']:>15.1f}{r['decode_tok_s']:>15.1f}"
              f"{r['decode_tok_s'] / base['decode_tok_s']:>13.2f}x")
    result = {
        "benchmark": "cpu_throughput", "date": datetime.date.today().isoformat(),
        "device": jax.devices()[0].device_kind, "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "jax": jax.__version__, "numpy": np.__version__,
        "args": {k: v for k, v in vars(args).items() if k != "out"}, "results": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cpu_throughput-{result['date']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
