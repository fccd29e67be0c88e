"""AdaptCache's profile for a token-tier engine's stored rows: the quality each row form keeps.

    python benchmarks/adapt_rows.py [--policy leankv] [--forms h2o@0.5,streaming@0.5,...]
        [--update jkv/store/profiles/smollm2-135m-rows.json]

A store behind a token-tier engine (kv_policy leankv, h2o, streaming) holds tiered rows, and
AdaptCache's smaller forms of a row drop tokens (`jkv.kv.row_forms`: `streaming@<keep>`
keeps the sinks and the newest tokens, `h2o@<keep>` the sinks, the recent window and the
most attended, by the attention scores the row stores). For each of the fidelity harness's
documents (prose, code, chat; `kv_fidelity.documents`), SmolLM2 under `--policy` prefills all
but the last 512 tokens; that row is taken out of the pool as the store keeps it, put in each
form and restored, and the last 512 tokens are fed teacher-forced after it. Quality: the
top-1 agreement of each form's predictions with those after the row as it was kept (the
store's full form); rate: the form's page bytes over the row's. Writes
benchmarks/results/adapt_rows/adapt_rows-<policy>-<date>.json and prints a table; `--update
PROFILE`
writes the profile (`jkv.store.adapt_profile.Profile`, methods = the forms, families
`rows-<way>`) to PROFILE, keeping a decode_bps it already has.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from harness import add_out_argument, write_results  # noqa: E402
from kv_fidelity import CHUNK, PAGE, TAIL, documents  # noqa: E402

from jkv.config import CacheConfig, EngineConfig  # noqa: E402
from jkv.engine.engine import Engine, Row  # noqa: E402
from jkv.engine.sampling import SamplingParams  # noqa: E402
from jkv.engine.saved_pages import SavedPages  # noqa: E402
from jkv.kv.tier_entries import TIER_ARRAYS  # noqa: E402
from jkv.models import load_params  # noqa: E402
from jkv.models.loaders import default_model_path  # noqa: E402
from jkv.models.tokenizer import load_tokenizer  # noqa: E402
from jkv.policies.stored_forms import parse_row_form  # noqa: E402
from jkv.store.adapt_profile import Profile  # noqa: E402

FORMS = "streaming@0.75,streaming@0.5,streaming@0.25,h2o@0.75,h2o@0.5,h2o@0.25"
FEED = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)


def feed(engine: Engine, slot: int, tokens: list[int], after: list[int]) -> list[int]:
    """Feed `tokens` to `slot` in prefill chunks; the top-1 prediction after each of them
    (`after`: the token following each fed one, for the teacher-forced targets)."""
    key, top1 = engine.request_key(0), []
    for at in range(0, len(tokens), CHUNK):
        chunk = tokens[at: at + CHUNK]
        [out], _ = engine.step([Row(slot, chunk, FEED, key, 0, after[at: at + CHUNK])], [])
        top1 += [int(ids[0]) for ids in out.positions[1]]
    return top1


def page_bytes(arrays: dict) -> int:
    return sum(np.asarray(x).nbytes for k, x in arrays.items() if k not in TIER_ARRAYS)


def measure(engine: Engine, doc: list[int], forms: list[str]) -> dict:
    """One document: each form's rate and top-1 agreement with the full row's predictions."""
    history, tail = doc[:-TAIL], doc[-TAIL:]
    slot, _ = engine.open(history + tail[:1])
    feed(engine, slot, history, history[1:] + tail[:1])
    saved = engine.save_pages(slot)
    engine.close(slot, keep=False)
    full_bytes, pool = page_bytes(saved.arrays), engine.kv_format
    out, base = {}, None
    for form in ["full", *forms]:
        arrays = saved.arrays if form == "full" else engine.convert_stored(
            saved.arrays, pool, form)
        slot, cached = engine.open(doc, restore=SavedPages(saved.num_blocks, arrays,
                                                           saved.hashes))
        if cached != len(history):
            raise SystemExit(f"{form}: restored {cached} tokens, expected {len(history)}")
        top1 = feed(engine, slot, doc[cached:-1], doc[cached + 1:])
        engine.close(slot, keep=False)
        base = top1 if base is None else base
        out[form] = {"rate": page_bytes(arrays) / full_bytes,
                     "top1_agreement": float(np.mean(np.equal(top1, base)))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", choices=("leankv", "h2o", "streaming"), default="leankv",
                    help="the engine's kv_policy (its other settings: jkv's defaults)")
    ap.add_argument("--forms", default=FORMS, help="comma-separated row forms <way>@<keep>")
    ap.add_argument("--doc-tokens", type=int, default=2048,
                    help=f"tokens of each document (more than {TAIL + CHUNK})")
    ap.add_argument("--update", metavar="PROFILE",
                    help="also write the profile to PROFILE (its decode_bps kept)")
    add_out_argument(ap, "adapt_rows")
    args = ap.parse_args()
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    bad = [f for f in forms if parse_row_form(f) is None]
    if bad or not forms:
        ap.error(f"--forms: not row forms <way>@<keep> (keep in (0, 1)): {bad or forms}")
    if args.doc_tokens <= TAIL + CHUNK:
        ap.error(f"--doc-tokens must be more than {TAIL + CHUNK}")

    path = default_model_path()
    cfg, params = load_params(None, jnp.float32)
    docs = documents(load_tokenizer(path), args.doc_tokens)
    engine = Engine(cfg, params, cache=CacheConfig(page_size=PAGE, kv_cache_bytes=1 << 30,
                                                   kv_policy=args.policy),
                    config=EngineConfig(max_model_len=args.doc_tokens + 16, max_num_seqs=1,
                                        prefill_chunk=CHUNK, attention_backend="xla",
                                        enable_prefix_caching=False))
    per_doc = {name: measure(engine, doc, forms)
               for name, doc in tqdm(docs.items(), desc="documents", unit="doc")}
    kinds = sorted(per_doc)
    table = {f: {"rate": float(np.mean([per_doc[k][f]["rate"] for k in kinds])),
                 "quality": {k: per_doc[k][f]["top1_agreement"] for k in kinds}}
             for f in forms}

    print(f"\nrow forms under kv_policy {args.policy} (top-1 agreement with the row as kept)")
    print(f"| form | rate | {' | '.join(kinds)} | mean |")
    print("|---|---|" + "---|" * (len(kinds) + 1))
    for f, row in table.items():
        q = [row["quality"][k] for k in kinds]
        print(f"| {f} | {row['rate']:.3f} | {' | '.join(f'{x:.3f}' for x in q)} | "
              f"{np.mean(q):.3f} |")
    write_results(args.out, f"adapt_rows-{args.policy}", {
        "benchmark": "adapt_rows", "device": jax.devices()[0].device_kind,
        "jax_version": jax.__version__, "policy": args.policy, "doc_tokens": args.doc_tokens,
        "tail": TAIL, "per_doc": per_doc, "forms": table}, args)
    if args.update:
        profile = {"model": "smollm2-135m", "metric": "top1_agreement", "kinds": kinds,
                   "methods": {f: [{"rate": row["rate"], "quality": row["quality"],
                                    "family": f"rows-{parse_row_form(f)[0]}"}]
                               for f, row in table.items()}}
        target = Path(args.update)
        if target.exists():
            old = json.loads(target.read_text())
            profile["decode_bps"] = {b: {m: r for m, r in rates.items() if m in table}
                                     for b, rates in old.get("decode_bps", {}).items()}
        Profile.from_json(profile)  # validated before it is written
        target.write_text(json.dumps(profile, indent=1) + "\n")
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
