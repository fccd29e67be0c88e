"""`python -m jkv.cluster`: jkv replicas on Ray Serve behind one OpenAI-compatible address,
each request routed to the replica that holds its conversation's KV. Every server flag works
per replica; the cluster's own flags choose the replicas and the router. Runs on the Ray
cluster at RAY_ADDRESS, else starts a local one, and stops on SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import threading

from jkv.cluster.shared_store import share_store
from jkv.config import OPTIONS
from jkv.server.flags import api_key, build_parser

log = logging.getLogger("jkv.cluster")
APP_FLAGS = ("served_model_name", "max_queue", "request_timeout", "ttft_slo_ms", "tpot_slo_ms",
             "metrics_require_key", "max_messages", "max_prompt_chars")


def cluster_parser() -> argparse.ArgumentParser:
    """The server's flags (each replica's), and the cluster's."""
    p = build_parser()
    p.prog = "python -m jkv.cluster"
    p.description = ("Serve a model from several jkv replicas on Ray Serve behind one "
                     "OpenAI-compatible API; a request goes to the replica holding its "
                     "conversation's KV. Every server flag applies to each replica; with "
                     "--store-dir (or --store-spec) the replicas share that one persistent "
                     "KV tier through an OCDBT coordinator this command starts (or the one "
                     "at --store-coordinator), each keeping its own host tier.")
    g = p.add_argument_group("cluster options")
    g.add_argument("--replicas", type=int, default=2, help="jkv replicas, each an LLM")
    g.add_argument("--router", default="kv", choices=["kv", "pow2", "prefix"],
                   help="how a request picks its replica: kv (the replica that served its "
                        "session, else the one holding the longest prefix of its prompt, "
                        "within --route-bound), pow2 (Ray Serve's default: the shorter queue "
                        "of two), prefix (Ray's PrefixCacheAffinityRouter, by prompt text)")
    g.add_argument("--route-bound", type=int, default=4,
                   help="with --router kv: a replica holding the request's KV is passed over "
                        "when its queue is longer than the shortest by more than this many "
                        "requests")
    g.add_argument("--replica-cpus", type=float, default=0.5,
                   help="CPUs Ray reserves for each replica (fractions allowed)")
    g.add_argument("--ray-cpus", type=int, default=None,
                   help="logical CPUs of the local Ray instance started when RAY_ADDRESS is "
                        "not set (Ray places replicas by them); default: the machine's, or "
                        "what the replicas, the ingress and the prefix router's actor need")
    return p


def main(argv: list[str] | None = None) -> None:
    parser = cluster_parser()
    args = parser.parse_args(argv)
    try:
        key = api_key(args, os.environ)
    except ValueError as e:
        parser.error(str(e))
    if args.replicas < 1 or args.replica_cpus <= 0 or args.route_bound < 0:
        parser.error("--replicas and --replica-cpus must be positive and --route-bound at "
                     f"least 0, got {args.replicas}, {args.replica_cpus}, {args.route_bound}")
    for flag in ("max_queue", "request_timeout", "ttft_slo_ms", "tpot_slo_ms", "max_messages",
                 "max_prompt_chars"):
        if (value := getattr(args, flag)) is not None and value <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive, got {value}")
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jkv").setLevel(args.log_level.upper())
    from jkv.cluster import deploy  # (Ray: the cluster extra)

    llm_options, coordinator = share_store(
        {o.name: getattr(args, o.name) for o in OPTIONS}, args.replicas,
        deploy.node_address() if os.environ.get("RAY_ADDRESS") else "127.0.0.1")
    app_options = {f: getattr(args, f) for f in APP_FLAGS} | {"api_key": key}
    app = deploy.application(llm_options, app_options, replicas=args.replicas,
                             router=args.router, bound=args.route_bound,
                             replica_cpus=args.replica_cpus)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # logical CPUs: Ray schedules by them; Ray's prefix router adds an actor that needs one
    need = math.ceil(args.replicas * args.replica_cpus + 0.1) + (args.router == "prefix")
    cpus = args.ray_cpus or max(os.cpu_count() or 1, need)
    deploy.start(app, host=args.host, port=args.port, num_cpus=cpus)
    log.info("serving %d replicas on http://%s:%d/v1 (router %s)", args.replicas, args.host,
             args.port, args.router)
    try:
        stop.wait()
    finally:
        log.info("stopping")
        deploy.stop()
        del coordinator  # (after the replicas)


if __name__ == "__main__":
    main()
