"""Verified restores, measured (`python benchmarks/restore.py --verify`): how far a restore's
fingerprint is from the one its entry keeps, over the fidelity documents and chats, for each
KV policy and format; what planted corruptions give; what the check costs.

For every configuration (policy:format) each of `kv_fidelity.documents`' prose, code and
chat (`--doc-tokens` long) is a first turn twice: a document (one token answered, so the
token after the saved blocks was computed in a prefill chunk) and a chat (`--answer-tokens`
answered: computed while decoding). Its next turn (the history and `--new-tokens` more of
the document) restores it through the scheduler, whose check records each distance
(`jkv.store.verify.distance`), apart for fingerprints computed over the pool's KV alone
(pooled: the chats') and inside a prefill chunk (the documents'): the largest over these
honest restores, times `MARGIN`, is the tolerance this benchmark proposes
(`jkv.store.verify.TOLERANCE` holds what it printed); a failed check there is a false alarm.
The same turns run again with each entry planted (its bytes whole and checksummed): another
document's pages ("other"), or its pages moved to other layers ("moved"); each must be
caught and answer as a run without a store does (under a token policy a prompt's
compression depends on what shared its steps: answers may differ). The cost: a restored
follow-up's time to first token and a decode step's time with the fingerprints computed in
each step and with them stubbed out (compiled apart), and the check's host-side time.
"""

from __future__ import annotations

import argparse
import math
import time
from statistics import median

import jax
import jax.numpy as jnp
import numpy as np
from harness import write_results
from kv_fidelity import documents
from plots import RESULTS

import jkv.engine.runner as runner_module
import jkv.sched.store_side as store_side
from jkv.config import CacheConfig, EngineConfig, SchedulerConfig, StoreConfig
from jkv.engine.engine import Engine, Row, SavedPages
from jkv.engine.fingerprints import SKETCH_DIMS
from jkv.engine.sampling import SamplingParams
from jkv.kv.tier_entries import TIER_ARRAYS
from jkv.models.loaders import default_model_path
from jkv.models.params_cache import load_params
from jkv.models.tokenizer import load_tokenizer
from jkv.sched.scheduler import Request, Scheduler, generate_all
from jkv.store.codec import decode, encode
from jkv.store.entry_forms import HASHES
from jkv.store.store import KVStore
from jkv.store.verify import MARK, MARK_AT, distance, tolerance

PAGE = 16
GREEDY = SamplingParams(max_tokens=1, temperature=0)
MARGIN = 2.0  # the tolerance proposed: this times the largest honest distance measured
CONFIGS = ("none:auto,none:int8,none:int4,none:k8v4,none:k4v2,none:k2v2,none:k8v4t,"
           "none:k4v2t,none:k4v8t,none:k2v4t,kivi:k2v2,leankv:k8v4t,leankv:k4v8t,"
           "streaming:auto,h2o:auto,snapkv:auto")
_KEEP = {HASHES, MARK_AT, MARK, *TIER_ARRAYS}  # an entry's arrays that are not its pages


class Distances:
    """Every distance the scheduler's checks compute while inside `with`, by whether the
    entry's fingerprint was pooled (`values["pooled"]`, `values["chunk"]`)."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {"pooled": [], "chunk": []}
        self._distance, self._plan_check = store_side.distance, store_side.plan_check
        self._pooled: dict[int, bool] = {}  # by id of a check's vector

    def __enter__(self) -> Distances:
        store_side.distance, store_side.plan_check = self._record, self._plan
        return self

    def __exit__(self, *exc) -> None:
        store_side.distance, store_side.plan_check = self._distance, self._plan_check

    def _plan(self, mark, *args):
        check = self._plan_check(mark, *args)
        if check is not None:
            self._pooled[id(check.vector)] = mark.pooled
        return check

    def _record(self, stored: np.ndarray, computed: np.ndarray) -> float:
        far = self._distance(stored, computed)
        self.values["pooled" if self._pooled[id(stored)] else "chunk"].append(far)
        return far


def _engine(cfg, params, policy: str, fmt: str, max_len: int, chunk: int) -> Engine:
    return Engine(cfg, params, cache=CacheConfig(page_size=PAGE, kv_cache_bytes=600 << 20,
                                                 kv_format=fmt, kv_policy=policy),
                  config=EngineConfig(max_model_len=max_len, max_num_seqs=4,
                                      prefill_chunk=chunk, enable_prefix_caching=False))


def _run(eng: Engine, prompts: list[list[int]], answer: int, store: bool
         ) -> tuple[list[list[int]], Scheduler]:
    sched = Scheduler(eng, SchedulerConfig(restore_planning=False), store=StoreConfig(
        host_cache_bytes=1 << 32, save_interval_blocks=0) if store else None)
    reqs = [Request(list(p), SamplingParams(max_tokens=answer, temperature=0)) for p in prompts]
    generate_all(sched, reqs)
    if store:
        sched.store.flush()
    return [r.output for r in reqs], sched


def _plant(store: KVStore, key: str, donor: str, kind: str) -> bool:
    """Rewrite entry `key` whole and checksummed with `donor`'s pages ("other") or its own
    moved (blocks: by one layer; a token-tier row: by half its page rows, most to another
    layer); False where the shapes do not allow it."""
    info, arrays = decode(store.host.get(key))
    if kind == "other":
        _, given = decode(store.host.get(donor))
        if any(given[k].shape != a.shape for k, a in arrays.items() if k not in _KEEP):
            return False
        pages = {k: given[k] for k in arrays if k not in _KEEP}
    else:  # blocks [n, layers, ...]; a token-tier row's pages [rows, ...]
        rows = TIER_ARRAYS[0] in arrays
        pages = {k: np.roll(a, max(1, len(a) // 2) if rows else 1, axis=0 if rows else 1)
                 for k, a in arrays.items() if k not in _KEEP}
    store.host.put(key, encode(info, {**arrays, **pages}), store.host.meta(key))
    return True


def measure_config(cfg, params, config: str, docs: dict, args) -> dict:
    """Honest and planted restores of `config` (policy:format) over the documents."""
    policy, fmt = config.split(":")
    n1 = args.doc_tokens + 3
    eng = _engine(cfg, params, policy, fmt, n1 + args.answer_tokens + args.new_tokens + 8,
                  args.prefill_chunk)
    out = {"config": config, "pooled": [], "chunk": [], "planted": [], "false_alarms": 0,
           "unverified": 0,
           "caught": 0, "planted_runs": 0, "wrong_answers": 0, "honest_differ": 0}
    names = list(docs)
    for _, answer in (("document", 1), ("chat", args.answer_tokens)):
        follow = alone = None
        for kind in ("honest", "other", "moved"):
            first, sched = _run(eng, [docs[n][:n1] for n in names], answer, store=True)
            store = sched.store
            if follow is None:  # (greedy: every run's first turns answer alike)
                follow = [docs[n][:n1] + o + docs[n][n1:n1 + args.new_tokens]
                          for n, o in zip(names, first, strict=True)]
                alone, _ = _run(eng, follow, args.new_answer, store=False)
            keys = [store.lookup(eng.cache.prompt_hashes(p)).key for p in follow]
            # (a next turn whose entry could not be planted, rows of other shapes, is left out)
            runs = [i for i, k in enumerate(keys)
                    if kind == "honest" or _plant(store, k, keys[(i + 1) % len(keys)], kind)]
            turn2 = [Request(follow[i], SamplingParams(max_tokens=args.new_answer,
                                                       temperature=0)) for i in runs]
            with Distances() as d:
                generate_all(sched, turn2)
            st = sched.stats
            if kind == "honest":
                out["pooled"] += d.values["pooled"]
                out["chunk"] += d.values["chunk"]
                out["false_alarms"] += st.verify_failures
                out["unverified"] += st.restores_unverified
                # (lossy formats: a restore, like a call of other shapes, may round otherwise)
                out["honest_differ"] += sum(r.output != alone[i]
                                            for r, i in zip(turn2, runs, strict=True))
            else:
                out["planted"] += d.values["pooled"] + d.values["chunk"]
                out["planted_runs"] += len(runs)
                out["caught"] += st.verify_failures
                out["wrong_answers"] += sum(r.output != alone[i]
                                            for r, i in zip(turn2, runs, strict=True))
            store.close()
    for kind in ("pooled", "chunk"):
        out[f"max_{kind}"] = max(out[kind], default=0.0)
        out[f"proposed_{kind}"] = _round_up(MARGIN * out[f"max_{kind}"])
        out[f"tolerance_{kind}"] = tolerance(eng.cache.token_policy, eng.kv_format,
                                             pooled=kind == "pooled")
    out["min_planted"] = min(out["planted"], default=float("nan"))
    return out


def _round_up(x: float) -> float:
    """`x` rounded up to two significant digits."""
    if x <= 0:
        return 0.0
    unit = 10.0 ** (math.floor(math.log10(x)) - 1)
    return round(math.ceil(x / unit) * unit, 12)


def _no_marks(hidden, positions, valid, sketch, page_size):
    """`fingerprints.marks` stubbed out: nothing gathered, nothing projected."""
    b = hidden.shape[0]
    return (jax.numpy.full((b, 2), -1, jax.numpy.int32),
            jax.numpy.zeros((b, 2, SKETCH_DIMS), jax.numpy.float32))


def measure_cost(cfg, params, args) -> dict:
    """A restored follow-up's time to first token and a decode step's time with fingerprints
    and with them stubbed out (two engines compiled apart, measured in turns so that the
    machine's load falls on both alike), and the check's host-side time."""
    rng = np.random.default_rng(0)
    history = rng.integers(0, cfg.vocab_size, args.cost_history).tolist()
    follow = history + rng.integers(0, cfg.vocab_size, args.new_tokens).tolist()
    real, engines = runner_module.marks, {}
    try:
        for label, marks in (("with", real), ("without", _no_marks)):
            runner_module.marks = marks  # (traced at the new engine's first calls)
            runner_module._compiled.cache_clear()
            eng = _engine(cfg, params, "none", "auto", len(follow) + 64, args.prefill_chunk)
            store = KVStore(StoreConfig(host_cache_bytes=1 << 32), model=eng.fingerprint,
                            kv_format=eng.kv_format, page_size=PAGE)
            slot, held = eng.open(history)
            _feed(eng, slot, history, held)
            saved = eng.gather(slot)
            store.save(saved.num_blocks, saved.arrays, saved.hashes)
            store.flush()
            eng.close(slot)
            _timed_turn(eng, store, follow)  # compiles every shape it takes
            engines[label] = (eng, store)
        times = {label: ([], []) for label in engines}
        for _ in range(args.repeats):
            for label, (eng, store) in engines.items():
                ttft, steps = _timed_turn(eng, store, follow)
                times[label][0].append(ttft)
                times[label][1].extend(steps)
    finally:
        runner_module.marks = real
        runner_module._compiled.cache_clear()
    out = {label: {"ttft_ms": 1e3 * median(t), "decode_step_ms": 1e3 * median(s)}
           for label, (t, s) in times.items()}
    for _, store in engines.values():
        store.close()
    a, b = rng.standard_normal((2, SKETCH_DIMS)).astype(np.float32)
    t0 = time.perf_counter()
    for _ in range(1000):
        distance(a, b)
    out["check_us"] = (time.perf_counter() - t0) * 1e3
    # the fingerprints' own part of a call, alone: a prefill chunk's row and a decode row
    out["marks_us"] = {f"{b}x{t}": _marks_us(cfg.hidden_size, b, t, args.repeats)
                       for b, t in ((1, args.prefill_chunk), (1, 1))}
    out["ttft_overhead"] = out["with"]["ttft_ms"] / out["without"]["ttft_ms"] - 1
    out["decode_overhead"] = out["with"]["decode_step_ms"] / out["without"]["decode_step_ms"] - 1
    return out


def _marks_us(hidden_size: int, rows: int, tokens: int, repeats: int) -> float:
    """Microseconds `fingerprints.marks` takes alone on `rows` x `tokens` hidden states."""
    fn = jax.jit(runner_module.marks, static_argnums=4)
    args = (jnp.ones((rows, tokens, hidden_size)), jnp.arange(tokens)[None].repeat(rows, 0),
            jnp.ones((rows, tokens), bool), jnp.ones((hidden_size, SKETCH_DIMS)), PAGE)
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(20 * repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
    return 1e6 * median(samples)


def _timed_turn(eng: Engine, store: KVStore, follow: list[int]) -> tuple[float, list[float]]:
    """Seconds to `follow`'s first token restored from `store`, and of 8 decode steps."""
    t0 = time.perf_counter()
    hit = store.lookup(eng.cache.prompt_hashes(follow))
    loaded = store.load(hit)
    slot, held = eng.open(follow, restore=SavedPages(hit.blocks, loaded.arrays, loaded.hashes))
    token = _feed(eng, slot, follow, held)
    ttft, steps = time.perf_counter() - t0, []
    for i in range(8):
        t0 = time.perf_counter()
        (s,) = eng.step([], [Row(slot, [token], GREEDY, eng.request_key(0), i)])[1]
        token = s.token
        steps.append(time.perf_counter() - t0)
    eng.close(slot)
    return ttft, steps


def _feed(eng: Engine, slot: int, prompt: list[int], held: int) -> int:
    key = eng.request_key(0)
    while held < len(prompt):
        chunk = prompt[held:held + eng.prefill_chunk]
        (s,), _ = eng.step([Row(slot, chunk, GREEDY, key, 0)], [])
        held += len(chunk)
    return s.token


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """`restore.py`'s options for `--verify` (beside its --model, --new-tokens,
    --prefill-chunk, --repeats and --out)."""
    ap.add_argument("--verify", action="store_true",
                    help="measure verified restores instead (restore_verify.py): honest and "
                         "planted restores' distances per policy:format, and the cost")
    ap.add_argument("--verify-configs", default=CONFIGS, help="--verify: policy:format list")
    ap.add_argument("--verify-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="--verify: the model's dtype")
    ap.add_argument("--doc-tokens", type=int, default=1024,
                    help="--verify: tokens of each fidelity document's first turn")
    ap.add_argument("--answer-tokens", type=int, default=24,
                    help="--verify: tokens a chat's first turn answers (decoded)")
    ap.add_argument("--new-answer", type=int, default=8,
                    help="--verify: tokens each next turn answers (compared with no store)")
    ap.add_argument("--cost-history", type=int, default=1024,
                    help="--verify: history tokens of the cost measurement (0: none)")


def verify(args: argparse.Namespace) -> None:
    """`restore.py --verify`: `verify_main` on the model; its results written."""
    dtype = jnp.dtype(args.verify_dtype)
    cfg, params = load_params(args.model, dtype)
    device = jax.devices()[0]
    tag = "cpu" if device.platform == "cpu" else device.device_kind.replace(" ", "_").lower()
    result = verify_main(cfg, params, args)
    out = RESULTS / "restore_verify" if args.out == RESULTS / "restore" else args.out
    write_results(out, f"restore_verify-{tag}-{dtype.name}",
                  {"model": args.model or "smollm2", "dtype": dtype.name, **result}, args)


def verify_main(cfg, params, args) -> dict:
    """Every configuration of `args.verify_configs`, then the cost; prints a line per
    configuration and returns the rows and the cost."""
    tokenizer = load_tokenizer(args.model or default_model_path())
    docs = documents(tokenizer, args.doc_tokens + 3 + args.new_tokens)
    rows = []
    for config in [c for c in args.verify_configs.split(",") if c]:
        t0 = time.perf_counter()
        rows.append(measure_config(cfg, params, config, docs, args))
        r = rows[-1]
        print(f"{config:>16} honest {len(r['pooled']) + len(r['chunk'])} (unverified "
              f"{r['unverified']}, false alarms {r['false_alarms']}) max pooled "
              f"{r['max_pooled']:.3g}, in a chunk {r['max_chunk']:.3g} -> tolerances "
              f"{r['proposed_pooled']:.2g}, {r['proposed_chunk']:.2g} (in code "
              f"{r['tolerance_pooled']}, {r['tolerance_chunk']}); planted "
              f"{r['caught']}/{r['planted_runs']} caught, min {r['min_planted']:.3g}; answers "
              f"unlike a run without a store: {r['wrong_answers']} planted, "
              f"{r['honest_differ']} honest  [{time.perf_counter() - t0:.0f} s]",
              flush=True)
    cost = measure_cost(cfg, params, args) if args.cost_history else None
    if cost is not None:
        print(f"cost: TTFT {cost['with']['ttft_ms']:.1f} ms with fingerprints, "
              f"{cost['without']['ttft_ms']:.1f} ms without ({100 * cost['ttft_overhead']:+.1f}"
              f" %); decode step {cost['with']['decode_step_ms']:.2f} / "
              f"{cost['without']['decode_step_ms']:.2f} ms ({100 * cost['decode_overhead']:+.1f}"
              f" %); a check {cost['check_us']:.1f} us; the fingerprints alone "
              + ", ".join(f"{k} {v:.0f} us" for k, v in cost["marks_us"].items()))
    return {"rows": rows, "cost": cost}
