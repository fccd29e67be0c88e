"""The request handlers' logic behind the app's routes (`Server`): a request is admitted and
tokenized (`jkv.server.admission`) and submitted to the LLM's scheduler loop, which runs on
its own thread; the handler waits on an asyncio queue the loop's callbacks feed and answers
with OpenAI's response bodies, whole or streamed as SSE. Kept apart from the routes
(`jkv.server.app`) so these can be read as the HTTP surface alone."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from jkv.api import LLM, Truncation
from jkv.engine.sampling import SamplingParams
from jkv.server.admission import Admission, ClientGone, Limits, deadline_error
from jkv.server.protocol import APIError, SamplingRequest

# a GGUF file's quantization suffix (`.Q4_1`, `-IQ3_M`, `.F16`, `.BF16`): the model answers
# to its name without it too
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|B?F16|F32)$", re.IGNORECASE)

try:  # chat templates raise jinja2 errors for conversations they reject
    from jinja2 import TemplateError as _TemplateError
except ImportError:  # pragma: no cover - jinja2 comes with transformers
    _TemplateError = ValueError

log = logging.getLogger("jkv.server")

CHAT_MAX_TOKENS = 512  # chat default for max_tokens, when the room left allows it
COMPLETION_MAX_TOKENS = 16  # completions default for max_tokens (OpenAI's)
_END = object()  # end of a stream's deltas
# a route's prompt maker: (tokens to reserve for the reply, cancelled) -> ids, truncation
MakeIds = Callable[[int, Callable[[], bool]], tuple[list[int], Truncation | None]]


class Server:
    """The request handlers' logic around an LLM whose scheduler loop runs on its own thread.

    Handlers are admitted and tokenize on a small thread pool (`Admission`), `submit` to
    the loop, and wait on an asyncio queue that the loop's callbacks feed. A client that goes
    away cancels its tokenization or aborts its request (its pages are freed at the loop's
    next step). A request's deadline counts from its arrival, tokenizing included."""

    def __init__(self, llm: LLM, served_model_name: str | None, max_queue: int | None,
                 request_timeout: float | None, ttft_slo_ms: float | None = None,
                 tpot_slo_ms: float | None = None, limits: Limits | None = None,
                 warm: bool = False) -> None:
        self.llm, self.warm = llm, warm
        self.name = served_model_name or llm.model_name
        self.aliases = {self.name, _QUANT_SUFFIX.sub("", self.name)}
        self.request_timeout = request_timeout
        self.ttft_slo_ms, self.tpot_slo_ms = ttft_slo_ms, tpot_slo_ms  # for requests without
        self.admission = Admission(llm, max_queue, limits or Limits())
        self.closing = self.admission.closing
        self.created = int(time.time())
        self.in_flight: set = set()

    def start(self) -> None:
        self.llm.start_serving(warm=self.warm)

    def close(self) -> None:
        self.admission.close()
        self.llm.close()

    def abort_all(self) -> None:
        self.admission.cancel_all()
        for r in list(self.in_flight):
            self.llm.abort(r)

    # ------------------------------------------------------------ on the tokenizer pool

    def _prepare(self, make_ids: MakeIds, body: SamplingRequest, max_tokens: int | None,
                 default_max: int, param: str, cancelled: Callable[[], bool]
                 ) -> tuple[list[int], SamplingParams, Truncation | None]:
        # room a session's prompt keeps for the reply when its oldest turns must go
        reserve = max_tokens or min(default_max, self.llm.max_model_len // 4)
        try:
            ids, truncation = make_ids(reserve, cancelled)
        except (ValueError, _TemplateError) as e:
            raise APIError(400, str(e), param=param) from e
        room = self.llm.max_model_len - len(ids)
        if room < 1:
            raise APIError(400, f"the prompt has {len(ids)} tokens and leaves no room to "
                                f"generate within max_model_len={self.llm.max_model_len}",
                           param=param)
        if max_tokens is not None and max_tokens > room:  # as OpenAI and vLLM answer it
            raise APIError(400, f"max_tokens={max_tokens} and the prompt's {len(ids)} tokens "
                                f"exceed max_model_len={self.llm.max_model_len}; at most "
                                f"{room} tokens can be generated for this prompt",
                           param="max_tokens")
        max_tokens = min(default_max if max_tokens is None else max_tokens, room)
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=-1 if body.top_k is None else body.top_k,
                seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids,
                ignore_eos=body.ignore_eos, logprobs=body.logprobs_wanted())
        except ValueError as e:
            raise APIError(400, str(e)) from e
        return ids, params, truncation

    # ------------------------------------------------------------ on the event loop

    def _submit(self, ids: list[int], params: SamplingParams, body: SamplingRequest,
                queue: asyncio.Queue, truncation: Truncation | None, arrival: float):
        loop = asyncio.get_running_loop()

        def put(item) -> None:  # from the scheduler's thread
            with contextlib.suppress(RuntimeError):  # the event loop is gone
                loop.call_soon_threadsafe(queue.put_nowait, item)

        request = self.llm.submit(
            ids, params, on_delta=lambda text, entries: put((text, entries)),
            on_finish=lambda t: put((_END, t)),
            session_id=body.session_id, priority=body.priority or 0,
            ttft_slo_ms=self.ttft_slo_ms if body.ttft_slo_ms is None else body.ttft_slo_ms,
            tpot_slo_ms=self.tpot_slo_ms if body.tpot_slo_ms is None else body.tpot_slo_ms,
            truncation=truncation, timeout_s=self.request_timeout, arrival=arrival)
        self.in_flight.add(request)
        return request

    def _failed(self, tracker) -> APIError | None:
        reason = tracker.finish_reason
        if reason == "timeout":
            return deadline_error(self.request_timeout)
        if reason == "error":
            return APIError(500, "internal server error while generating", type="server_error")
        if reason == "abort" and self.closing.is_set():
            return APIError(503, "the server is shutting down", type="server_error")
        return None

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.aliases:
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                                f"'{self.name}'", param="model", code="model_not_found")

    def model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "jkv",
                "root": self.name, "parent": None,  # (no file path: it is the host's)
                "max_model_len": self.llm.max_model_len}

    async def complete(self, request: Request, body: SamplingRequest, chat: bool,
                       make_ids: MakeIds, max_tokens: int | None):
        arrival = time.monotonic()
        timeout = self.request_timeout
        self.check_model(body.model)
        self.admission.refuse_if_busy()
        default_max = CHAT_MAX_TOKENS if chat else COMPLETION_MAX_TOKENS
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            ids, params, truncation = await self.admission.prepare(
                request, lambda cancelled: self._prepare(
                    make_ids, body, max_tokens, default_max, "messages" if chat else "prompt",
                    cancelled),
                None if timeout is None else arrival + timeout, timeout)
        except ClientGone:
            log.info("client went away while its prompt was made; dropped %s", rid)
            return JSONResponse({}, status_code=499)
        if self.closing.is_set():
            raise APIError(503, "the server is shutting down", type="server_error")
        request.state.prompt_tokens = len(ids)
        created = int(time.time())
        queue: asyncio.Queue = asyncio.Queue()
        handle = self._submit(ids, params, body, queue, truncation, arrival)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _Stream(self._stream(request, chat, rid, created, ids, handle, queue,
                                        include_usage), lambda: self._abort(handle))
        t = await self._finished(request, rid, handle, queue)
        if (err := self._failed(t)) is not None:
            raise err
        if t.finish_reason == "abort":
            return JSONResponse({}, status_code=499)
        request.state.completion_tokens = len(t.token_ids)
        logprobs = self._logprobs(t.logprobs, chat) if params.logprobs is not None else None
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": t.text},
                      "logprobs": logprobs, "finish_reason": t.finish_reason}
        else:
            choice = {"index": 0, "text": t.text, "logprobs": logprobs,
                      "finish_reason": t.finish_reason}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": self.name, "choices": [choice],
                "usage": _usage(len(ids), len(t.token_ids), handle)}

    async def _finished(self, request: Request, rid: str, handle,
                        queue: asyncio.Queue):
        """The tracker of a non-streamed request once it ends; a client gone (looked for
        every half second, tokens arriving or not) aborts it."""
        try:
            checked = time.monotonic()
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), timeout=0.5)
                except TimeoutError:
                    item = None
                if time.monotonic() - checked >= 0.5 or item is None:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        log.info("client went away; aborting %s", rid)
                        self._abort(handle)
                if item is not None and item[0] is _END:
                    return item[1]
        finally:
            self._abort(handle)  # a no-op once finished

    def _logprobs(self, entries: list, chat: bool, offset: int = 0) -> dict:
        """OpenAI's logprobs object for (token id, logprob, top ids, top logprobs) entries."""
        tok = self.llm.tokenizer

        def text(i: int) -> str:
            return tok.decode([i]) if tok is not None else str(i)

        if chat:
            def item(i: int, lp: float) -> dict:
                t = text(i)
                return {"token": t, "logprob": lp, "bytes": list(t.encode())}

            return {"content": [{**item(i, lp), "top_logprobs": [
                item(j, v) for j, v in zip(ids, lps, strict=True)]}
                for i, lp, ids, lps in entries]}
        tokens = [text(i) for i, *_ in entries]
        offsets = [offset + sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _, _ in entries],
                "top_logprobs": [{text(j): v for j, v in zip(ids, lps, strict=True)}
                                 for _, _, ids, lps in entries],
                "text_offset": offsets}

    def _abort(self, handle) -> None:
        self.in_flight.discard(handle)
        if not handle.finished:
            self.llm.abort(handle)

    async def _stream(self, request: Request, chat: bool, rid: str, created: int,
                      ids: list[int], handle, queue: asyncio.Queue,
                      include_usage: bool) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        want = handle.sampling.logprobs is not None
        sent = 0  # characters streamed, for completions' text_offset

        def chunk(text: str | None = None, finish: str | None = None, role: bool = False,
                  usage: dict | None = None, choices: bool = True,
                  entries: list | None = None) -> str:
            nonlocal sent
            logprobs = self._logprobs(entries or [], chat, sent) if want and not role else None
            sent += len(text or "")
            if chat:
                delta = {"role": "assistant", "content": ""} if role else {}
                if text is not None:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "logprobs": logprobs,
                          "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": logprobs,
                          "finish_reason": finish}
            out = {"id": rid, "object": obj, "created": created, "model": self.name,
                   "choices": [choice] if choices else []}
            if include_usage:
                out["usage"] = usage
            return f"data: {json.dumps(out, ensure_ascii=False)}\n\n"

        try:
            if chat:
                yield chunk(role=True)
            while True:
                item = await queue.get()
                if item[0] is _END:
                    t = item[1]
                    break
                yield chunk(item[0], entries=item[1])
            if (err := self._failed(t)) is not None:
                raise err
            if t.finish_reason == "abort":
                return
            request.state.completion_tokens = len(t.token_ids)
            yield chunk(finish=t.finish_reason, entries=t.take_logprobs())
            if include_usage:
                yield chunk(usage=_usage(len(ids), len(t.token_ids), handle),
                            choices=False)
        except APIError as e:
            request.state.stream_error = e.message
            yield f"data: {json.dumps(e.body())}\n\n"
        except Exception as e:  # headers are sent: report the error in the stream
            log.exception("error while streaming %s", rid)
            request.state.stream_error = f"{type(e).__name__}: {e}"
            yield f"data: {json.dumps(APIError.internal(e).body())}\n\n"
        finally:
            self._abort(handle)  # a no-op when finished; frees its pages otherwise
        yield "data: [DONE]\n\n"


def _usage(prompt: int, completion: int, handle) -> dict:
    """OpenAI's usage, with the prompt tokens whose KV was found cached (device or store)
    and, beyond OpenAI's fields, how many of them came from each tier."""
    details = {"cached_tokens": handle.cached_tokens or 0}
    if handle.cached_by_tier is not None:
        details["cached_tokens_by_tier"] = handle.cached_by_tier
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "prompt_tokens_details": details}


class _Stream(StreamingResponse):
    """An SSE response that stops its generation however the response ends."""

    def __init__(self, content: AsyncIterator[str], abort: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._abort = abort

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._abort()
