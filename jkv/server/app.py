"""The OpenAI-compatible application over `jkv.LLM` (`build_app`).

Endpoints: GET /health (liveness), GET /ready (readiness: 503 with the reason while new
work would be refused), GET /v1/models, GET /metrics, POST /v1/chat/completions,
POST /v1/completions (both with SSE streaming). The routes here are thin: each hands its
request to `jkv.server.handlers.Server`, which admits it (`jkv.server.admission`: body
limits, queue limit, a small tokenizer pool) and submits to the LLM's scheduler loop, which
runs on its own thread and batches every request in flight continuously.
`python -m jkv.server` (`jkv/server/__main__.py`) builds it from the command line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from jkv.api import LLM, Truncation
from jkv.server.admission import MAX_MESSAGES, MAX_PROMPT_CHARS, Limits
from jkv.server.guard import Guard
from jkv.server.handlers import Server
from jkv.server.protocol import (
    COMPLETION_RESPONSES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Readiness,
    error_responses,
    json_schema_bounds,
    validation_error,
)


def build_app(llm: LLM, served_model_name: str | None = None, *, api_key: str | None = None,
              max_queue: int | None = None, request_timeout: float | None = None,
              ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None,
              metrics_require_key: bool = False, max_messages: int | None = MAX_MESSAGES,
              max_prompt_chars: int | None = MAX_PROMPT_CHARS, warm: bool = False) -> FastAPI:
    """The OpenAI-compatible app around a loaded LLM; its scheduler loop runs while the app
    does (the LLM's offline `generate`/`chat` must not be called meanwhile).

    served_model_name: the model id clients ask for (default `llm.model_name`).
    api_key: when set, /v1 routes want `Authorization: Bearer <api_key>` (401 otherwise).
    max_queue: requests waiting (to be tokenized or in the scheduler's queue) beyond this are
    refused with 503 and Retry-After.
    request_timeout: seconds a request may take from arrival to its last token.
    ttft_slo_ms, tpot_slo_ms: the targets of requests that name none.
    metrics_require_key: the key guards every route but /health and /ready (/metrics, /docs,
    the schema).
    max_messages, max_prompt_chars: a chat with more messages, or a prompt (a chat's
    template text) with more characters, is a 400 naming the field; None: no limit.
    warm: once the loop starts, it compiles the step shapes a lone request takes while it
    has no work (`LLM.start_serving(warm=True)`).
    """
    server = Server(llm, served_model_name, max_queue, request_timeout, ttft_slo_ms,
                    tpot_slo_ms, Limits(max_messages, max_prompt_chars), warm=warm)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.start()
        try:
            yield
        finally:
            server.close()

    app = FastAPI(title="jkv", summary="OpenAI-compatible API over jkv.LLM", lifespan=lifespan)
    app.state.llm, app.state.served_model_name = llm, server.name
    app.state.server = server
    _add_error_handlers(app)
    _add_status_routes(app, server)
    _add_completion_routes(app, server)
    app.openapi = _openapi(app, llm)
    app.add_middleware(Guard, api_key=api_key, guard_all=metrics_require_key)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error, ours, a bad body's or Starlette's, answers OpenAI's error body; the first
    two are also left on the request for the access log."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        request.state.error = exc.message
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc)
        request.state.error = err.message
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(APIError(exc.status_code, str(exc.detail), code=code).body(),
                            status_code=exc.status_code, headers=exc.headers)


def _add_status_routes(app: FastAPI, server: Server) -> None:
    """The routes that report on the server rather than generate: health (the process is
    alive), readiness (it takes new work), metrics, models."""
    llm = server.llm

    @app.get("/health", responses={503: {
        "description": "the server is shutting down",
        "content": {"application/json": {"example": {"status": "draining"}}}}})
    async def health():
        if server.closing.is_set():
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/ready", response_model=Readiness, responses={503: {
        "model": Readiness, "description": "new work would be refused now: draining, the "
                                           "scheduler loop not running, or the queue full"}})
    async def ready():
        status, reason = server.admission.readiness()
        if reason is not None:
            return JSONResponse(Readiness(status=status, reason=reason).model_dump(),
                                status_code=503)
        return Readiness(status=status)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus metrics (text exposition format)"}})
    async def metrics() -> Response:
        llm.metrics.sync(llm.stats())
        llm.metrics.tokenizing.set(server.admission.tokenizing)
        return Response(llm.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=error_responses(401))
    async def models() -> dict:
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model_id:path}", responses=error_responses(401, 404))
    async def model(model_id: str) -> dict:
        server.check_model(model_id)
        return server.model_card()


def _add_completion_routes(app: FastAPI, server: Server) -> None:
    """The two generating routes: each turns its body into prompt ids (`make_ids`) for
    `Server.complete`."""
    llm = server.llm

    @app.post("/v1/chat/completions", responses=COMPLETION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
        max_tokens = (body.max_completion_tokens if body.max_completion_tokens is not None
                      else body.max_tokens)

        server.admission.check_chat(messages)
        max_chars = server.admission.limits.max_prompt_chars

        def make_ids(reserve: int, cancelled: Callable[[], bool]
                     ) -> tuple[list[int], Truncation | None]:
            if body.session_id is None:
                return llm.chat_prompt(messages, max_chars=max_chars), None
            # session mode: may truncate, checking `cancelled` between renders
            return llm.session_prompt(messages, reserve, max_chars=max_chars,
                                      cancelled=cancelled)

        return await server.complete(request, body, True, make_ids, max_tokens)

    @app.post("/v1/completions", responses=COMPLETION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        server.admission.check_prompt(body.prompt)
        return await server.complete(request, body, False,
                                     lambda _reserve, _cancelled: (llm.encode(body.prompt),
                                                                   None),
                                     body.max_tokens)


def _openapi(app: FastAPI, llm: LLM) -> Callable[[], dict]:
    """The app's `openapi`: FastAPI's schema, built once, with the bounds this model sets."""

    def openapi() -> dict:
        """FastAPI's schema less the 422 it documents for every body: a bad body is a 400
        here (`validation_error`), whose shape `error_responses` documents."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary,
                                 routes=app.routes)
            for operations in schema["paths"].values():
                for op in operations.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            vocab = llm.cfg.vocab_size  # token ids are the model's
            prompt = schema["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
            for option in prompt.get("anyOf", ()):
                if option.get("items", {}).get("type") == "integer":
                    option["items"]["maximum"] = vocab - 1
            # (a chat's max_tokens is ignored beside max_completion_tokens: no bound stated)
            for body, field in (("CompletionRequest", "max_tokens"),
                                ("ChatCompletionRequest", "max_completion_tokens")):
                for option in schema["components"]["schemas"][body]["properties"][field].get(
                        "anyOf", ()):
                    if option.get("type") == "integer":  # the prompt takes a token at least
                        option["le"] = llm.max_model_len - 1
            app.openapi_schema = json_schema_bounds(schema)
        return app.openapi_schema

    return openapi
