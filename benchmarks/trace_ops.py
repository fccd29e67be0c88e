"""Where a traced run's time went, op by op, charged to the jax operations that made each op.

    python benchmarks/trace_ops.py TRACE_DIR [HLO_DIR] [--top 25] [--module _layer_step]
    python benchmarks/trace_ops.py TRACE_DIR --host

TRACE_DIR holds a `jax.profiler` trace written with create_perfetto_trace=True (for example
`tier_cost.py --trace`); HLO_DIR the optimized HLO that XLA dumped in the same process
(XLA_FLAGS="--xla_dump_to=HLO_DIR --xla_dump_hlo_pass_re=^$"). Every XLA op event is charged
to its module and to the jax operation its HLO metadata names (op_name, such as
jit(_layer_step)/jit(xla_attention)/while/body/add), or to the op's own name without HLO_DIR.
While loops, calls and conditionals are left out (the ops in their bodies are counted), so a
module's rows add up to the time its ops ran. Where one module name was compiled several times
(other shapes), an op's metadata comes from the dump that defines most of the traced ops.
Times are per run of the module (its distinct run ids in the trace).

With `--host`, what the host's python thread spent its time in instead (each function's and
jax call's inclusive time and count over the whole trace: a call that holds the caller, such
as a copy waiting for the device, shows as a long leaf), and per device thread (compute
streams, copy engines) how long it was busy (the union of its events) and on what.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
from pathlib import Path

CONTAINERS = ("while", "call", "conditional")
OP_NAME = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = .*?metadata=\{op_name="([^"]*)"', re.M)


def load_events(trace_dir: Path) -> list[dict]:
    """The complete ('X') events that name an XLA module and op."""
    files = sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not files:
        raise SystemExit(f"no perfetto_trace.json.gz under {trace_dir}")
    data = json.load(gzip.open(files[-1]))
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]


def thread_names(events: list[dict]) -> dict[tuple, str]:
    """(pid, tid) -> "process/thread" from the trace's metadata events."""
    proc = {e["pid"]: e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"}
    return {(e["pid"], e["tid"]): f'{proc.get(e["pid"], e["pid"])}/{e["args"]["name"]}'
            for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}


def busy_ms(events: list[dict]) -> float:
    """The union of the events' intervals, in ms."""
    total, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e["ts"]):
        start, stop = e["ts"], e["ts"] + e["dur"]
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total / 1e3


def host_report(trace_dir: Path, top: int) -> None:
    """The python thread's calls by inclusive time, and each device thread's busy time."""
    files = sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not files:
        raise SystemExit(f"no perfetto_trace.json.gz under {trace_dir}")
    data = json.load(gzip.open(files[-1]))
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = thread_names(events)
    by_thread: dict[str, list[dict]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            by_thread[names.get((e["pid"], e["tid"]), f'{e["pid"]}/{e["tid"]}')].append(e)
    span = [min(e["ts"] for evs in by_thread.values() for e in evs),
            max(e["ts"] + e["dur"] for evs in by_thread.values() for e in evs)]
    print(f"trace: {(span[1] - span[0]) / 1e3:.1f} ms")
    for thread, evs in sorted(by_thread.items()):
        python = thread.endswith("/python")
        if not python and thread.startswith("/host:CPU"):
            continue  # XLA's own host threads (CPU backend ops: the module report)
        ms: collections.Counter = collections.Counter()
        count: collections.Counter = collections.Counter()
        for e in evs:
            ms[e["name"][:80]] += e["dur"] / 1e3
            count[e["name"][:80]] += 1
        print(f"\n{thread}: busy {busy_ms(evs):.1f} ms"
              + (" (inclusive times)" if python else ""))
        for name, t in ms.most_common(top):
            print(f"  {t:9.3f} ms {count[name]:6d}x  {name}")


def op_names(hlo_dir: Path, module: str, ops: set[str]) -> dict[str, str]:
    """op -> jax op_name from the dump of `module` that defines the most of `ops`."""
    best: dict[str, str] = {}
    for path in hlo_dir.glob(f"*.{module}.*after_optimizations.txt"):
        names = dict(OP_NAME.findall(path.read_text()))
        if len(ops & names.keys()) > len(ops & best.keys()):
            best = names
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace_dir", type=Path, help="the jax.profiler trace directory")
    ap.add_argument("hlo_dir", type=Path, nargs="?", default=None,
                    help="XLA's dump of the same run (optional)")
    ap.add_argument("--top", type=int, default=25, help="rows per module")
    ap.add_argument("--host", action="store_true",
                    help="report the python thread's calls and device threads' busy time "
                         "instead of ops by module")
    ap.add_argument("--module", default="",
                    help="only modules whose name contains this (default: all)")
    args = ap.parse_args()
    if args.host:
        host_report(args.trace_dir, args.top)
        return

    by_module: dict[str, list[dict]] = collections.defaultdict(list)
    for e in load_events(args.trace_dir):
        module, op = e["args"].get("hlo_module", "?"), e["args"]["hlo_op"]
        if args.module in module and not op.startswith(CONTAINERS):
            by_module[module].append(e)
    total = {m: sum(e["dur"] for e in evs) for m, evs in by_module.items()}
    for module in sorted(by_module, key=total.get, reverse=True):
        events = by_module[module]
        runs = len({e["args"].get("run_id") for e in events}) or 1
        names = (op_names(args.hlo_dir, module, {e["args"]["hlo_op"] for e in events})
                 if args.hlo_dir else {})
        ms: collections.Counter = collections.Counter()
        for e in events:
            op = e["args"]["hlo_op"]
            ms[re.sub(r"^jit\([^)]*\)/", "", names.get(op, op))] += e["dur"] / 1e3 / runs
        per_run = total[module] / 1e3 / runs
        print(f"\n{module}: {runs} runs, {per_run:.3f} ms of ops per run")
        for name, t in ms.most_common(args.top):
            print(f"  {t:9.3f} ms  {t / per_run:6.1%}  {name}")


if __name__ == "__main__":
    main()
