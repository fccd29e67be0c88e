"""The OpenAI API as jkv's server speaks it: request bodies (pydantic models whose JSON
Schema states every bound the server checks), the error shape every failure is answered in,
and how a validation failure becomes a 400 naming its field. No serving here (`jkv.server`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)

from jkv.engine.sampling import MAX_LOGPROBS
from jkv.prompts import ROLES

MAX_STOP = 4
_INT64 = 1 << 63


# ---------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status, message, param, type, code)
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    @classmethod
    def internal(cls, e: BaseException) -> APIError:
        """The 500 an unexpected exception is answered with."""
        return cls(500, f"internal server error: {type(e).__name__}: {e}", type="server_error")


class Readiness(BaseModel):
    """GET /ready's body: whether new work is taken now, and if not, why."""

    status: Literal["ready", "draining", "starting", "queue_full"]
    reason: str | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error's body (OpenAI's shape)."""

    error: ErrorDetail


_ERRORS = {400: "the request is invalid; the message names the field (`param`)",
           401: "a missing or wrong API key (the server was started with --api-key)",
           404: "no such model, or no such route",
           413: "the request body is too large",
           503: "the queue is full (Retry-After), the request ran past its deadline "
                "(Retry-After), or the server is shutting down"}


_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def json_schema_bounds(node: Any) -> Any:
    """Bounds in JSON Schema's words: pydantic writes a number's ge/le as they are when a
    validator runs before them (`JsonInt`), which no schema reader understands."""
    if isinstance(node, dict):
        typed = node.get("type") in ("integer", "number")
        return {(_BOUNDS[k] if typed and k in _BOUNDS else k): json_schema_bounds(v)
                for k, v in node.items()}
    if isinstance(node, list):
        return [json_schema_bounds(v) for v in node]
    return node


def error_responses(*codes: int) -> dict:
    """OpenAPI `responses` for these error statuses, each with the error body."""
    return {c: {"model": ErrorResponse, "description": _ERRORS[c]} for c in codes}


COMPLETION_RESPONSES = {
    200: {"description": "the completion as JSON, or with `stream: true` as server-sent "
                         "events (`data: {chunk}` lines, then `data: [DONE]`)",
          "content": {"application/json": {}, "text/event-stream": {}}},
    **error_responses(400, 401, 404, 413, 503)}


def validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error as a 400 whose message names the field."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ())]
    if loc and loc[0] == "body":
        loc = loc[1:]
    kind = err.get("type", "")
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return APIError(400, f"request body is not valid JSON: {detail}".rstrip(": "))
    if not loc:
        if kind == "missing":
            return APIError(400, "request body is missing; send a JSON object")
        return APIError(400, "request body must be a JSON object (Content-Type: "
                             "application/json)")
    msg = err.get("msg", "invalid value")
    if kind == "value_error" and "ctx" in err:  # our validators: drop pydantic's prefix
        msg = str(err["ctx"].get("error", msg))
    field = ".".join(loc)
    if kind == "missing":
        return APIError(400, f"'{field}' is a required field", param=loc[0])
    return APIError(400, f"'{field}': {msg}", param=loc[0])


# ---------------------------------------------------------------------------- request bodies


def _json_number(value: Any) -> Any:
    """A JSON number: a boolean is none (pydantic's lax mode would take it as 0 or 1)."""
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


JsonInt = Annotated[int, BeforeValidator(_json_number)]  # 2.0 is 2, as JSON Schema has it
JsonFloat = Annotated[float, BeforeValidator(_json_number)]
Flag = Annotated[bool, Field(strict=True)]  # true or false, never "yes" or 1


def _text_content(value: Any) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValueError("only text content parts ({'type': 'text', 'text': ...}) "
                                 "are supported")
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a string 'text'")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError("content must be a string or a list of text parts")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal[ROLES]
    # parts are joined into one string before validation (`_content`); null is ""
    content: str | list[TextPart] | None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> str:
        return _text_content(value)


class StreamOptions(BaseModel):
    include_usage: Flag = False


class SamplingRequest(BaseModel):
    """Fields shared by chat and completion requests; unknown fields are ignored."""

    model: str | None = None
    max_tokens: JsonInt | None = Field(None, ge=1, description=(
        "tokens to generate at most; default 512 for chat, 16 for completions, and never "
        "more than the context leaves (more than it leaves is a 400)"))
    temperature: JsonFloat | None = Field(None, ge=0, le=2)
    top_p: JsonFloat | None = Field(None, gt=0, le=1)
    top_k: JsonInt | None = Field(None, ge=-1)
    seed: JsonInt | None = Field(None, ge=-_INT64, lt=_INT64)
    stop: (Annotated[str, Field(min_length=1)]
           | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)]
           | None) = None
    stop_token_ids: list[JsonInt] | None = None
    ignore_eos: Flag = False
    stream: Flag | None = False
    stream_options: StreamOptions | None = None
    n: JsonInt | None = Field(1, ge=1, le=1, description="one choice per request")
    best_of: JsonInt | None = Field(None, ge=1, le=1, description="not supported beyond 1")
    user: str | None = None
    # jkv extensions: a conversation's name, and what the scheduler was promised
    session_id: str | None = Field(None, max_length=256)
    priority: JsonInt | None = Field(None, ge=-1_000_000, le=1_000_000)  # lower goes first
    ttft_slo_ms: JsonFloat | None = Field(None, gt=0, le=3_600_000)
    tpot_slo_ms: JsonFloat | None = Field(None, gt=0, le=3_600_000)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if value is None:
            return value
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("stop must be a string or a list of strings")
        if len(value) > MAX_STOP:
            raise ValueError(f"stop takes at most {MAX_STOP} strings, got {len(value)}")
        if not all(value):
            raise ValueError("stop strings must not be empty")
        return value or None

    @field_validator("n", "best_of", mode="before")
    @classmethod
    def _one_choice(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, 1):
            what = ("only n=1 is supported (one choice per request)" if info.field_name == "n"
                    else "best_of is not supported")
            raise ValueError(f"{what}, got {value}")
        return value


class ResponseFormat(BaseModel):
    type: Literal["text"] = Field(description="only text: jkv has no structured output")


class ChatCompletionRequest(SamplingRequest):
    # top_logprobs needs logprobs: true (as OpenAI and vLLM have it)
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"top_logprobs": {"type": "integer"}},
               "required": ["top_logprobs"]},
        "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}})

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: JsonInt | None = Field(None, ge=1)
    logprobs: Flag | None = None
    top_logprobs: JsonInt | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                         description="needs `logprobs: true`")
    # what jkv does not do is refused (a 400 naming the field), never silently ignored
    response_format: ResponseFormat | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=0)] | None = Field(
        None, description="tool calls are not supported: null or []")
    tool_choice: Literal["none"] | None = Field(None, description="tool calls are not "
                                                "supported: null or \"none\"")

    def logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingRequest):
    prompt: (Annotated[str, Field(min_length=1)]
             | Annotated[list[Annotated[JsonInt, Field(ge=0)]], Field(min_length=1)]
             | Annotated[list[Annotated[str, Field(min_length=1)]],
                         Field(min_length=1, max_length=1)]) = Field(
        description="text, token ids below the model's vocabulary size, or a list of one "
                    "text (one prompt per request)")
    echo: Literal[False] | None = False
    logprobs: JsonInt | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        """A string, token ids, or a one-element list of either."""
        shape = ("prompt must be a string, a list of token ids, or a one-element list of "
                 "either")
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(shape)
        if value and all(isinstance(v, str | list) for v in value):
            if len(value) != 1:
                raise ValueError(f"only one prompt per request (got {len(value)})")
            value = value[0]
            if isinstance(value, str):
                return value
        if not all(isinstance(t, int | float) and not isinstance(t, bool)
                   and float(t).is_integer() for t in value):
            raise ValueError(shape)
        value = [int(t) for t in value]
        return value

    @field_validator("echo", mode="before")
    @classmethod
    def _echo(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, bool):
            raise ValueError("echo must be a boolean")
        if value:
            raise ValueError("echo is not supported")
        return value

    def logprobs_wanted(self) -> int | None:
        return self.logprobs
