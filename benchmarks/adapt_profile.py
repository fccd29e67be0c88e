"""AdaptCache's offline quality profile, from the fidelity harness's measurements.

    python benchmarks/kv_fidelity.py                       # measure (SmolLM2, ~1 h on a CPU)
    python benchmarks/adapt_profile.py \
        benchmarks/results/kv_fidelity/kv_fidelity-2026-11-26.json

Each configuration of the fidelity run becomes a point of a compression method: `none:<format>`
is the method <format> (quantized pages) and `kivi` KIVI, all of the family "quantized"
(requantized from a finer format they keep their own quality); `streaming:<window>` is
StreamingLLM's token dropping. Only methods a store can apply to an entry it holds, without
the model, are profiled: LeanKV's tiers and H2O choose tokens by attention scores, which a
stored entry does not keep. Rate: the configuration's KV bytes over bf16 pages' (the
harness's `bytes_vs_bf16`; a store holding bf16 entries keeps that fraction of their bytes);
quality: its teacher-forced top-1 agreement with the uncompressed run (`none:auto`) on each
document kind (prose, code, chat). Writes the profile
(`jkv.store.adapt_profile.Profile`) to
benchmarks/results/adapt_profile/adapt_profile-<model>-<date>.json.

The estimator's decode cost, per JAX backend (the rate a store converts an entry of each
method back into the pool's format at, the store's own figure until it has measured one):

    python benchmarks/adapt_profile.py --update jkv/store/profiles/smollm2-135m.json --decode

times `kv_forms.convert_pages` on random KV of the model's shape (SmolLM2-135M's by default:
30 layers, 3 KV heads, head_dim 64, 16-token pages) into the model dtype this backend runs
(float32 on a CPU, bf16 on a GPU), the median of `--repeats` after one compiling call, and
adds the rates under the backend's name (`--decode` with a fidelity result: into the new
profile).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import add_out_argument, write_results  # noqa: E402

from jkv.store.adapt_profile import Profile  # noqa: E402

FULL = "none:auto"
ALIASES = {"kivi": "k2v2"}  # a method's stored KV format, where not its name (decode rates)
NEEDS_SCORES = ("leankv", "h2o")


def method_of(config: str) -> str:
    """The compression method a fidelity configuration measures."""
    parts = [p for p in config.split(":") if "=" not in p]
    return parts[1] if parts[0] == "none" else parts[0]


def build(fidelity: dict, model: str) -> Profile:
    rows = fidelity["rows"]
    if FULL not in rows:
        raise SystemExit(f"the fidelity run has no {FULL!r} row to take rates against")
    kinds = sorted(rows[FULL]["docs"])
    methods: dict[str, list[dict]] = {}
    for config, row in rows.items():
        method = method_of(config)
        if (config == FULL or row["bytes_vs_bf16"] >= 1 or method in NEEDS_SCORES
                or config.endswith("-unrotated")):
            continue  # (not smaller than bf16; not made without the model; a control)
        quality = {k: row["docs"][k]["top1_agreement"] for k in kinds}
        methods.setdefault(method, []).append(
            {"rate": row["bytes_vs_bf16"], "quality": quality, "config": config,
             **({"family": "quantized"} if method != "streaming" else {})})
    return Profile.from_json({"model": model, "metric": "top1_agreement", "kinds": kinds,
                              "methods": methods})


def add_shared_forms(profile: Profile, frontier: dict) -> Profile:
    """`profile` with the shared-layer forms `krul@<rate>` a kv_frontier result measured (its
    groups chosen per conversation, pre-RoPE keys: the store's form): per rate, the entry's
    bytes over bf16 pages and each kind's teacher-forced top-1 agreement."""
    methods = profile.to_json()["methods"]
    for label, row in frontier["rows"].items():
        way, _, rate = label.partition("@")
        if way != "chosen:pre":
            continue
        quality = {kind: next(r["top1_agreement"]
                              for name, r in frontier["docs"][kind]["rows"].items()
                              if name.startswith("chosen:pre:") and name.endswith(f"@{rate}"))
                   for kind in profile.kinds}
        methods[f"krul@{rate}"] = [{"rate": row["rate"], "quality": quality,
                                    "family": "shared"}]
    return Profile.from_json({**profile.to_json(), "methods": methods})


def measure_decode(methods: list[str], layers: int, kv_heads: int, head_dim: int,
                   page_size: int, tokens: int, repeats: int) -> dict[str, float]:
    """Stored bytes per second each of `methods` (KV formats) is converted back into a pool
    in the model dtype at, for an entry of `tokens` tokens."""
    import jax
    import numpy as np
    from tqdm import tqdm

    from jkv.api import resolve_dtype
    from jkv.kv.format import KVFormat
    from jkv.kv.kv_forms import convert_pages
    from jkv.kv.pages import KVPages

    dtype, pool = resolve_dtype("auto"), KVFormat.parse("auto")
    rng = np.random.default_rng(0)
    shape = (tokens // page_size, layers, kv_heads, page_size, head_dim)
    k, v = (jax.numpy.asarray(rng.standard_normal(shape, np.float32)) for _ in "kv")
    full = {n: np.asarray(x) for n, x in KVPages.from_dense(k, v, pool, dtype).arrays().items()}
    out = {}
    for method in tqdm(methods, desc=f"decode ({jax.default_backend()})", unit="method"):
        fmt = KVFormat.parse(ALIASES.get(method, method))
        stored = convert_pages(full, pool, fmt, dtype)
        nbytes = sum(x.nbytes for x in stored.values())
        convert_pages(stored, fmt, pool, dtype)  # compiles
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            convert_pages(stored, fmt, pool, dtype)
            times.append(time.perf_counter() - t0)
        out[method] = nbytes / statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("fidelity", nargs="?", help="a kv_fidelity-<date>.json result")
    ap.add_argument("--update", metavar="PROFILE",
                    help="instead of a fidelity result: a profile JSON to add decode rates "
                         "to (rewritten in place; with --decode)")
    ap.add_argument("--frontier", metavar="RESULT",
                    help="a kv_frontier result: its shared-layer forms (krul@<rate>) join the "
                         "profile, so AdaptCache may choose them")
    ap.add_argument("--model", default="smollm2-135m",
                    help="the model the fidelity run measured (named in the profile)")
    ap.add_argument("--decode", action="store_true",
                    help="also time converting each storable method back into the pool's "
                         "format on this backend (the profile's decode_bps)")
    ap.add_argument("--layers", type=int, default=30, help="--decode: the model's layers")
    ap.add_argument("--kv-heads", type=int, default=3, help="--decode: its KV heads")
    ap.add_argument("--head-dim", type=int, default=64, help="--decode: its head dim")
    ap.add_argument("--page-size", type=int, default=16, help="--decode: tokens per page")
    ap.add_argument("--tokens", type=int, default=512, help="--decode: tokens of the entry")
    ap.add_argument("--repeats", type=int, default=15, help="--decode: timed conversions")
    add_out_argument(ap, "adapt_profile")
    args = ap.parse_args()
    if (args.fidelity is None) == (args.update is None):
        ap.error("give a fidelity result or --update PROFILE (not both)")
    if args.update is not None and not args.decode:
        ap.error("--update adds decode rates: give --decode")
    if args.page_size < 1 or args.tokens < args.page_size or args.repeats < 1:
        ap.error("--page-size, --repeats must be >= 1 and --tokens >= --page-size")
    update = None if args.update is None else Path(args.update)
    profile = (Profile.load(update) if update is not None
               else build(json.loads(Path(args.fidelity).read_text()), args.model))
    if args.frontier is not None:
        profile = add_shared_forms(profile, json.loads(Path(args.frontier).read_text()))
    if args.decode:
        import jax

        from jkv.kv.format import KV_FORMATS

        rates = measure_decode([m for m in profile.methods
                                if ALIASES.get(m, m) in KV_FORMATS], args.layers,
                               args.kv_heads, args.head_dim, args.page_size, args.tokens,
                               args.repeats)
        profile = dataclasses.replace(
            profile, decode_bps={**profile.decode_bps, jax.default_backend(): rates})
        print(f"{'method':<10}{'decode GB/s':>12}   ({jax.default_backend()}, "
              f"{args.tokens}-token entries)")
        for method, bps in rates.items():
            print(f"{method:<10}{bps / 1e9:>12.3f}")
        write_results(args.out, f"adapt_decode-{args.model}-{jax.default_backend()}",
                      {"benchmark": "adapt_decode", "device": jax.devices()[0].device_kind,
                       "jax": jax.__version__, "backend": jax.default_backend(),
                       "decode_bps": rates}, args)
        if update is not None:  # its other fields (the source it names) kept
            data = json.loads(update.read_text())
            data["decode_bps"] = profile.to_json()["decode_bps"]
            update.write_text(json.dumps(data, indent=1) + "\n")
            print(f"wrote {update}")
            return
    print(f"{'method':<22}{'rate':>7}  " + "".join(f"{k:>8}" for k in profile.kinds))
    for method, points in profile.methods.items():
        for p in points:
            print(f"{method:<22}{p.rate:>7.3f}  "
                  + "".join(f"{p.quality[k]:>8.3f}" for k in profile.kinds))
    write_results(args.out, f"adapt_profile-{args.model}",
                  {"benchmark": "adapt_profile", "source": Path(args.fidelity).name,
                   **profile.to_json()}, args)


if __name__ == "__main__":
    main()
