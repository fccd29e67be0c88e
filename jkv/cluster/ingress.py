"""The cluster's ingress: an ASGI app that forwards every request, as it came, to a replica
chosen by the deployment's request router, and streams the replica's answer back.

It reads only what routing needs (`Hasher`): the session id and the prompt's chained block
hashes, made with the replicas' tokenizer, chat template, page size and hash seed, so they are
the hashes a replica holds the prompt's KV under. A body it cannot read is forwarded anyway:
the replica's app answers it with the server's own 4xx.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from jkv.cluster.asgi import RoutedRequest
from jkv.kv.prefix_cache import block_hashes
from jkv.models.tokenizer import load_tokenizer
from jkv.prompts import render
from jkv.server.guard import Guard

MAX_ROUTED_CHARS = 1 << 20  # prompts longer than this are routed by session alone


class Hasher:
    """A request body's routing keys, as the replicas described by `info` (`Replica.info`)
    would hash its prompt."""

    def __init__(self, info: dict) -> None:
        self.tokenizer = load_tokenizer(info["model_path"])
        self.page_size, self.seed = info["page_size"], info["hash_seed"]

    def keys(self, body: dict) -> dict:
        """session, hashes, prompt and messages of a chat or completion body; what cannot
        be read is left out (the replica answers the request)."""
        keys: dict = {"session": body.get("session_id")}
        try:
            if isinstance(body.get("messages"), list):
                text = render(self.tokenizer, body["messages"])
            elif isinstance(body.get("prompt"), str):
                text = keys["prompt"] = body["prompt"]
            else:
                return keys
            if text:  # (Ray's prefix router reads the prompt as the model sees it)
                keys["messages"] = [{"role": "user", "content": text}]
            if len(text) <= MAX_ROUTED_CHARS:
                ids = self.tokenizer.encode(text)
                keys["hashes"] = block_hashes(ids, self.page_size, self.seed,
                                              (len(ids) - 1) // self.page_size)
        except Exception:  # (a bad message, a template error: the replica says so)
            pass
        return {k: v for k, v in keys.items() if v is not None}


def build_ingress(replicas, hasher: Callable[[], Awaitable[Hasher]]):
    """The forwarding app over the replica deployment's handle `replicas`; `await hasher()`
    gives the routing keys' maker (made on first use, in the ingress's own process). A body
    over the server's limit is refused here (413) before it is read whole."""

    async def forward(scope, receive, send) -> None:
        if scope["type"] != "http":  # (lifespan: nothing to start)
            if scope["type"] == "lifespan":
                while (await receive())["type"] != "lifespan.shutdown":
                    await send({"type": "lifespan.startup.complete"})
                await send({"type": "lifespan.shutdown.complete"})
            return
        request = Request(scope, receive)
        body = await request.body()
        try:
            parsed = json.loads(body) if body else {}
        except ValueError:
            parsed = {}
        keys = {}
        if isinstance(parsed, dict):  # (tokenizing off the event loop: others go on)
            keys = await asyncio.to_thread((await hasher()).keys, parsed)
        routed = RoutedRequest(scope["method"], scope["path"], scope.get("query_string", b""),
                               list(scope.get("headers", [])), body, **keys)
        parts = replicas.options(stream=True).handle.remote(routed)
        try:
            first = await parts.__anext__()
        except Exception as e:  # the replica died before answering
            response = JSONResponse({"error": {"message": f"the replica failed: {e}",
                                               "type": "server_error", "param": None,
                                               "code": None}}, status_code=503)
            await response(scope, receive, send)
            return
        _, status, headers = first

        async def body_parts():
            async for _, chunk in parts:
                yield chunk

        response = StreamingResponse(body_parts(), status_code=status)
        response.raw_headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        await response(scope, receive, send)

    return Guard(forward)  # (the body limit before the body is read; the key: the replica's)


__all__ = ["Hasher", "build_ingress"]
