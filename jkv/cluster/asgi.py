"""An HTTP request carried from the cluster's ingress to a replica (`RoutedRequest`), and its
run through the replica's own jkv app in process (`call_app`), streamed back as it is sent.

A replica serves every request with the very app `python -m jkv.server` serves (its routes,
errors, streaming and metrics), called as ASGI without a socket; the ingress only forwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass
class RoutedRequest:
    """What the ingress hands a replica: the HTTP request, and what the router reads of it
    (`session`, the prompt's chained block `hashes`; `messages`, which Ray's prefix-affinity
    router reads first: one message, the prompt as the model sees it; for a request
    without one, its method and path, as that router fails on an empty text)."""

    method: str
    path: str
    query: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    session: str | None = None
    hashes: list[bytes] = field(default_factory=list)
    prompt: str | None = None
    messages: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.messages:
            self.messages = [{"role": "user", "content": f"{self.method} {self.path}"}]


def _scope(r: RoutedRequest) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": r.method, "scheme": "http", "path": r.path, "raw_path": r.path.encode(),
            "query_string": r.query, "root_path": "", "headers": list(r.headers),
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}


async def call_app(app, request: RoutedRequest) -> AsyncIterator[tuple]:
    """Run `request` through the ASGI `app`: yields ("start", status, headers) once, then
    ("body", bytes) for each part the app sends. Closing the generator early tells the app
    the client went away (its request is aborted, as a dropped connection would)."""
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    task = asyncio.create_task(app(_scope(request), receive, send))
    try:
        while True:
            getter = asyncio.create_task(sent.get())
            done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:  # the app ended without another message
                getter.cancel()
                task.result()  # (its error, if it raised)
                return
            message = getter.result()
            if message["type"] == "http.response.start":
                yield ("start", message["status"], message.get("headers", []))
            elif message["type"] == "http.response.body":
                yield ("body", message.get("body", b""))
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()
        if not task.done():
            await asyncio.wait({task}, timeout=30)


__all__ = ["RoutedRequest", "call_app"]
