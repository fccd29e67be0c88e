"""The server's outermost ASGI layer (`Guard`): the API key on /v1 routes (401), a limit on
request bodies (413, also for chunked bodies, which are buffered up to the limit), a JSON 500
for any error nothing else answered, and one access-log line per request (token counts and
errors that handlers leave in the scope's state)."""

from __future__ import annotations

import hmac
import json
import logging
import time

from jkv.server.protocol import APIError

log = logging.getLogger("jkv.server")

MAX_BODY_BYTES = 1 << 20  # larger request bodies get 413
_PROBES = ("/health", "/ready")  # liveness and readiness: never behind the key, logged quietly


async def _send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


class Guard:
    """Outermost layer: API key, body-size limit, a JSON 500 for any unhandled error, one
    log line."""

    def __init__(self, app, max_body: int = MAX_BODY_BYTES, api_key: str | None = None,
                 guard_all: bool = False) -> None:
        self.app, self.max_body = app, max_body
        self.api_key = None if api_key is None else f"Bearer {api_key}".encode()
        # /v1 always; with guard_all every route but the probes (metrics, docs, the schema)
        self.guarded = (lambda path: path not in _PROBES) if guard_all else (
            lambda path: path.startswith("/v1"))

    def _authorized(self, scope) -> bool:
        if self.api_key is None or not self.guarded(scope.get("path", "")):
            return True
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        return hmac.compare_digest(given, self.api_key)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = None
        scope.setdefault("state", {})  # where handlers leave token counts for the log line

        async def send_wrapper(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if not self._authorized(scope):
                await _send_json(send_wrapper, 401, APIError(
                    401, "invalid or missing API key (Authorization: Bearer <key>)",
                    code="invalid_api_key").body())
                return
            limited = await self._limit_body(scope, receive)
            if limited is None:
                await _send_json(send_wrapper, 413, APIError(
                    413, f"request body is larger than {self.max_body} bytes",
                    code="request_too_large").body())
            else:
                await self.app(scope, limited, send_wrapper)
        except Exception as e:
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if status is None:
                await _send_json(send_wrapper, 500, APIError.internal(e).body())
        finally:
            self._log(scope, status, time.perf_counter() - start)

    async def _limit_body(self, scope, receive):
        """`receive`, or a replay of the buffered body; None when the body is too large."""
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_body
            except ValueError:
                too_big = False
            if not too_big:
                return receive
            if int(length) <= 64 * self.max_body:  # drain it so the client reads the 413
                while (await receive()).get("more_body"):
                    pass
            return None
        if b"chunked" not in headers.get(b"transfer-encoding", b"").lower():
            return receive
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.max_body:
                return None
            if not message.get("more_body"):
                break
        body, replayed = b"".join(parts), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay

    @staticmethod
    def _log(scope, status: int | None, seconds: float) -> None:
        state = scope.get("state") or {}
        path = scope.get("path", "")
        level = logging.DEBUG if path in _PROBES and status == 200 else logging.INFO
        if not log.isEnabledFor(level):
            return
        client = scope.get("client") or ("-", 0)
        extra = ""
        if "prompt_tokens" in state:
            extra = (f" prompt_tokens={state['prompt_tokens']} "
                     f"completion_tokens={state.get('completion_tokens', 0)}")
        for key in ("error", "stream_error"):
            if key in state:
                extra += f" {key}={state[key]!r}"
        log.log(level, '%s:%s "%s %s" %s%s %.3fs', client[0], client[1], scope.get("method"),
                path, status if status is not None else "disconnected", extra, seconds)
