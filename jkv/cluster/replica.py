"""One replica of a jkv cluster: an `LLM` and the very app `python -m jkv.server` serves over
it, run in process for the requests the ingress forwards (`handle`), and what it holds, for
the KV-aware router (`record_routing_stats`, which Ray Serve polls).

A plain class: `jkv.cluster.deploy` makes it a Ray Serve deployment, so this module runs (and
is tested) without Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections import OrderedDict
from collections.abc import AsyncIterator

from jkv.api import LLM
from jkv.cluster.asgi import RoutedRequest, call_app
from jkv.cluster.routing import ACTIVE_S, HASH_BYTES
from jkv.server.app import build_app

MAX_SESSIONS = 4096  # sessions a replica remembers serving, the latest


class Replica:
    """`llm_options`: `LLM`'s keyword arguments (the server's flags); `app_options`:
    `build_app`'s (served model name, API key, queue and timeout limits, SLOs)."""

    def __init__(self, llm_options: dict, app_options: dict) -> None:
        self.name = f"{socket.gethostname()}:{os.getpid()}"  # (one process per replica)
        self.llm = LLM(**llm_options)
        self.app = build_app(self.llm, **app_options)
        self._lifespan: contextlib.AbstractAsyncContextManager | None = None
        self._sessions: OrderedDict[str, float] = OrderedDict()  # served when, latest last
        self._started = asyncio.Lock()

    async def _start(self) -> None:
        """Run the app's startup (its scheduler loop) once, on the first request."""
        async with self._started:
            if self._lifespan is None:
                self._lifespan = self.app.router.lifespan_context(self.app)
                await self._lifespan.__aenter__()

    async def handle(self, request: RoutedRequest) -> AsyncIterator[tuple]:
        """The request through this replica's app: ("start", status, headers), then
        ("body", bytes) parts as the app sends them (`asgi.call_app`); the headers name the
        replica (`x-jkv-replica`), for operators and tests."""
        await self._start()
        if request.session is not None:
            self._sessions[request.session] = time.monotonic()
            self._sessions.move_to_end(request.session)
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        async for part in call_app(self.app, request):
            if part[0] == "start":
                part = (*part[:2], [*part[2], (b"x-jkv-replica", self.name.encode())])
            yield part

    def info(self, _probe: RoutedRequest | None = None) -> dict:
        """What the ingress needs to hash prompts as this replica does. (`_probe`: the empty
        request the ingress sends with the call, for routers that read every call's
        messages.)"""
        cache = self.llm.engine.cache
        return {"model_path": str(self.llm.model_path), "page_size": cache.page_size,
                "hash_seed": cache.hash_seed,
                "served_model_name": self.app.state.served_model_name}

    def record_routing_stats(self) -> dict:
        """Requests in flight, the sessions this replica served or holds, how many it served
        in the last ACTIVE_S seconds, and the first HASH_BYTES of every block hash its device
        prefix cache or its own store tiers hold (a chained hash held means its whole prefix
        is)."""
        server = self.app.state.server
        sched = self.llm.scheduler
        sessions = set(self._sessions)
        sessions |= {r.session_id for r in [*sched.running, *sched.waiting] if r.session_id}
        blocks = [h[:HASH_BYTES] for h in self.llm.engine.cache.cached_block_hashes()]
        store = self.llm.store
        if store is not None:
            with store.p.lock:
                held = [e for k, e in store.index.entries.items() if self._own(store, k)]
            sessions |= {e.session for e in held if e.session}
            blocks += [h[:HASH_BYTES] for e in held for h in e.hashes]
        return {"queue": len(server.in_flight), "sessions": sorted(sessions), "blocks": blocks,
                "active": self._active()}

    def _active(self) -> int:
        """Sessions served in the last ACTIVE_S seconds (the latest are last)."""
        since = time.monotonic() - ACTIVE_S
        count = 0
        for served in reversed(self._sessions.values()):
            if served < since:
                break
            count += 1
        return count

    @staticmethod
    def _own(store, key: str) -> bool:
        """Whether a stored entry is this replica's to restore faster than the others
        (under the store's lock): in its host tier, or on a disk it alone reads; an entry
        of a tier all replicas share is as near to each of them, not a reason to route."""
        return not store.p.shared or store.placement.where(key) == "host"

    async def close(self) -> None:
        """Run the app's shutdown (drains the scheduler loop)."""
        if self._lifespan is not None:
            await self._lifespan.__aexit__(None, None, None)
            self._lifespan = None


__all__ = ["Replica"]
