"""`python -m jkv.server`: load the model named by the flags, then serve it with uvicorn
until SIGTERM or SIGINT (which drain the requests in flight first)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import jax
import uvicorn

from jkv.api import LLM
from jkv.config import OPTIONS
from jkv.models.params_cache import cache_home
from jkv.server.app import build_app
from jkv.server.flags import api_key, build_parser
from jkv.server.handlers import Server

log = logging.getLogger("jkv.server")


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # before anything loads: a bad key setting is a usage error at once
        key = api_key(args, os.environ)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jkv").setLevel(args.log_level.upper())
    cache_dir = args.compilation_cache_dir
    if cache_dir is None:
        cache_dir = str(cache_home() / "xla")
    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
    if args.store_spec and args.store_spec.lstrip().startswith("{"):
        try:
            args.store_spec = json.loads(args.store_spec)
        except ValueError as e:
            parser.error(f"--store-spec is not valid JSON: {e}")
    try:
        llm = LLM(**{o.name: getattr(args, o.name) for o in OPTIONS})
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    cpu = jax.default_backend() == "cpu"
    if args.precompile or args.precompile is None and not cpu:
        t0 = time.perf_counter()
        n = llm.warmup()
        log.info("compiled %d step shapes in %.1f s", n, time.perf_counter() - t0)
    for flag in ("max_queue", "request_timeout", "drain_timeout", "ttft_slo_ms", "tpot_slo_ms",
                 "max_messages", "max_prompt_chars"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive, got {value}")
    app = build_app(llm, args.served_model_name, api_key=key,
                    max_queue=args.max_queue, request_timeout=args.request_timeout,
                    ttft_slo_ms=args.ttft_slo_ms, tpot_slo_ms=args.tpot_slo_ms,
                    metrics_require_key=args.metrics_require_key,
                    max_messages=args.max_messages, max_prompt_chars=args.max_prompt_chars,
                    warm=args.precompile is None and cpu)  # in the background, listening
    log.info("serving %r (max_model_len=%d) on http://%s:%d/v1", app.state.served_model_name,
             llm.max_model_len, args.host, args.port)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=False, timeout_graceful_shutdown=args.drain_timeout + 5)
    _Uvicorn(config, app.state.server, args.drain_timeout).run()


class _Uvicorn(uvicorn.Server):
    """SIGTERM/SIGINT drain: new requests get 503 at once, requests in flight may finish for
    `drain` seconds, then they are aborted so their responses end and the process exits."""

    def __init__(self, config: uvicorn.Config, server: Server, drain: float) -> None:
        super().__init__(config)
        self._server, self._drain = server, drain

    def handle_exit(self, sig: int, frame) -> None:
        if not self._server.closing.is_set():
            self._server.closing.set()
            log.info("draining: %d requests in flight, up to %.0f s",
                     len(self._server.in_flight), self._drain)
            timer = threading.Timer(self._drain, self._server.abort_all)
            timer.daemon = True
            timer.start()
        else:  # a second signal: stop now
            self._server.abort_all()
        super().handle_exit(sig, frame)


if __name__ == "__main__":
    main()
