"""The OpenAI-compatible server, in-process over real SmolLM2 weights, through real clients."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from jkv import LLM, SamplingParams  # noqa: E402
from jkv.server.app import build_app  # noqa: E402
from jkv.server.flags import build_parser  # noqa: E402

pytestmark = pytest.mark.smollm2

MAX_TOKENS = 8
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name one color of the rainbow."}]


def wait_until_healthy(base: str, alive: Callable[[], str | None], seconds: float) -> None:
    """Poll `base`/health until it answers 200; `alive()` names why the server died (None
    while it runs)."""
    deadline = time.monotonic() + seconds
    while True:
        died = alive()
        assert died is None, died
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"the server did not come up within {seconds} s"
        time.sleep(0.1)


@contextlib.contextmanager
def serving(llm, **app_kw):
    """`llm` behind a real uvicorn server on 127.0.0.1 (a free port), for the test's length."""
    app = build_app(llm, **app_kw)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_until_healthy(base, lambda: None if thread.is_alive() else "the server thread died",
                       60)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
    try:
        yield SimpleNamespace(llm=llm, app=app, base=base, client=client,
                              name=app.state.served_model_name,
                              http=httpx.Client(timeout=120))
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture(scope="module")
def srv():
    with serving(LLM(max_model_len=1024, max_num_seqs=4)) as s:
        yield s


def post(srv, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, bytes | str):
        return srv.http.post(srv.base + path, content=body,
                             headers={"content-type": "application/json"}, **kw)
    return srv.http.post(srv.base + path, json=body, **kw)


def through_loop(srv, ids: list[int], max_tokens: int = MAX_TOKENS):
    """Greedy output of the library for token ids, through the server's own scheduler loop."""
    done, out = threading.Event(), {}

    def on_finish(t) -> None:
        out["t"] = t
        done.set()

    srv.llm.submit(ids, SamplingParams(max_tokens=max_tokens, temperature=0),
                   on_finish=on_finish)
    assert done.wait(120), "the library request did not finish"
    t = out["t"]
    return SimpleNamespace(text=t.text, token_ids=t.token_ids, finish_reason=t.finish_reason,
                           prompt_token_ids=ids)


def library(srv, prompt, max_tokens: int = MAX_TOKENS):
    return through_loop(srv, srv.llm.encode(prompt), max_tokens)


def chat_greedy(srv, messages, max_tokens: int = MAX_TOKENS) -> str:
    r = srv.client.chat.completions.create(model=srv.name, messages=messages,
                                           max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content


def sse_events(resp: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE response, in order."""
    lines = [ln for ln in resp.text.split("\n") if ln]
    assert all(ln.startswith("data: ") for ln in lines), lines
    return [ln[len("data: "):] for ln in lines]


# ---------------------------------------------------------------------------- happy paths


def test_health_and_models(srv):
    r = srv.http.get(srv.base + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    models = srv.client.models.list()
    assert [m.id for m in models.data] == [srv.name]
    assert srv.name == srv.llm.model_name
    assert srv.client.models.retrieve(srv.name).id == srv.name
    text = srv.http.get(srv.base + "/v1/models").text
    assert str(srv.llm.model_path) not in text and "/" not in json.loads(text)["data"][0]["root"]
    base = srv.name.rsplit(".", 1)[0]  # the embedded file's name without ".Q4_1"
    assert base != srv.name and srv.client.models.retrieve(base).id == srv.name
    r = srv.client.completions.create(model=base, prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.model == srv.name


def test_chat_completion(srv):
    r = srv.client.chat.completions.create(model=srv.name, messages=CHAT,
                                           max_tokens=MAX_TOKENS, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.model == srv.name
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens == len(srv.llm.chat_prompt(CHAT))
    assert 1 <= u.completion_tokens <= MAX_TOKENS
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    # the library gives the same greedy reply
    assert choice.message.content == through_loop(srv, srv.llm.chat_prompt(CHAT)).text


def test_completion_matches_library(srv):
    expected = library(srv, PROMPT)
    r = srv.client.completions.create(model=srv.name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                      temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == expected.text
    assert r.choices[0].finish_reason == expected.finish_reason
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == len(expected.token_ids)
    # token-id prompts, bare and as a one-element batch, give the same text
    ids = expected.prompt_token_ids
    for prompt in (ids, [ids], [PROMPT]):
        r = post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS,
                                          "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected.text


def test_chat_stream_matches_non_stream(srv):
    expected = chat_greedy(srv, CHAT)
    stream = srv.client.chat.completions.create(
        model=srv.name, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last, usage = chunks
    text = "".join(c.choices[0].delta.content or "" for c in body + [last])
    assert text == expected
    assert all(c.choices[0].finish_reason is None for c in body)
    assert last.choices[0].finish_reason in ("stop", "length")
    assert usage.choices == [] and usage.usage.completion_tokens >= 1
    assert usage.usage.total_tokens == usage.usage.prompt_tokens + usage.usage.completion_tokens


def test_usage_reports_the_prompt_tokens_found_cached(srv):
    """OpenAI's usage.prompt_tokens_details.cached_tokens: 0 for a prompt never seen, the
    reused prefix (whole pages) when it comes again, streamed usage included."""
    prompt = f"{uuid.uuid4().hex} " + "one two three four five six seven eight " * 6
    first = srv.client.completions.create(model=srv.name, prompt=prompt, max_tokens=2,
                                          temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = srv.client.completions.create(model=srv.name, prompt=prompt, max_tokens=2,
                                          temperature=0)
    page = srv.llm.engine.cache.page_size
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert page <= cached < again.usage.prompt_tokens and cached % page == 0
    # (beyond OpenAI's fields: where they were found, here all on the device)
    by_tier = again.usage.prompt_tokens_details.model_extra["cached_tokens_by_tier"]
    assert by_tier["device"] == cached == sum(by_tier.values())
    *_, usage = srv.client.completions.create(
        model=srv.name, prompt=prompt, max_tokens=2, temperature=0, stream=True,
        stream_options={"include_usage": True})
    assert usage.usage.prompt_tokens_details.cached_tokens == cached


def test_a_chats_second_turn_reports_its_first_turn_as_cached(srv):
    """The acceptance's second turn through the `openai` client (by the model's base name):
    the next turn's cached_tokens are the whole pages it shares with what the first turn
    computed (its prompt and reply), as many as the prefix cache's hit counter moved."""
    base = srv.name.rsplit(".", 1)[0]
    chat = [{"role": "user", "content": f"{uuid.uuid4().hex}: name three colors of the "
                                        "rainbow, then say which is your favourite."}]
    hits = srv.llm.stats()["prefix_hit_tokens"]["device"]
    first = srv.client.chat.completions.create(model=base, messages=chat, max_tokens=24,
                                               temperature=0)
    # (only the template's system prompt, which every chat shares, can be found)
    assert (first.usage.prompt_tokens_details.cached_tokens
            == srv.llm.stats()["prefix_hit_tokens"]["device"] - hits)
    p1 = srv.llm.chat_prompt(chat)
    reply = through_loop(srv, p1, 24)  # the same greedy reply, its token ids
    assert reply.text == first.choices[0].message.content
    turn = [*chat, {"role": "assistant", "content": reply.text},
            {"role": "user", "content": "Why that one?"}]
    hits = srv.llm.stats()["prefix_hit_tokens"]["device"]
    second = srv.client.chat.completions.create(model=base, messages=turn, max_tokens=2,
                                                temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == srv.llm.stats()["prefix_hit_tokens"]["device"] - hits
    p2 = srv.llm.chat_prompt(turn)
    fed = p1 + reply.token_ids[:-1]  # (the last token sampled is not fed)
    common = next((i for i, (a, b) in enumerate(zip(p2, fed, strict=False)) if a != b),
                  min(len(p2), len(fed)))
    page = srv.llm.engine.cache.page_size
    assert p2[:len(p1)] == p1 and cached % page == 0
    assert len(p1) // page * page <= cached == common // page * page


def test_completion_stream_matches_non_stream(srv):
    expected = library(srv, PROMPT)
    stream = srv.client.completions.create(model=srv.name, prompt=PROMPT,
                                           max_tokens=MAX_TOKENS, temperature=0, stream=True)
    chunks = list(stream)
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason
    # the wire format: data lines, no usage without include_usage, [DONE] last
    r = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                      "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert all("usage" not in json.loads(e) for e in events[:-1])


def test_sampling_options(srv):
    # the same seed gives the same sample
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 1234}
    a, b = (post(srv, "/v1/completions", body).json() for _ in range(2))
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    # a stop string cuts the greedy text before it
    full = library(srv, PROMPT).text
    stop = full.strip().split()[1] if len(full.split()) > 1 else full.strip()[-1]
    r = srv.client.completions.create(model=srv.name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                      temperature=0, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    # content as a list of text parts; max_completion_tokens; model may be left out
    r = post(srv, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}],
        "max_completion_tokens": MAX_TOKENS, "temperature": 0, "session_id": "s1",
        "some_unknown_field": {"ignored": True}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == chat_greedy(srv, CHAT)


# ---------------------------------------------------------------------------- bad requests

_MSG = [{"role": "user", "content": "hi"}]
BAD = [
    # (path, body, status, param)
    ("/v1/chat/completions", b'{"messages": [', 400, None),
    ("/v1/chat/completions", b"", 400, None),
    ("/v1/chat/completions", [1, 2], 400, None),
    ("/v1/chat/completions", {"model": "x"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": _MSG, "temperature": 5}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": _MSG, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": _MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": _MSG, "max_tokens": 1.5}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": _MSG, "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("/v1/chat/completions", {"messages": _MSG, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": _MSG, "top_k": -2}, 400, "top_k"),
    ("/v1/chat/completions", {"messages": _MSG, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/chat/completions", {"messages": _MSG, "stop": ""}, 400, "stop"),
    ("/v1/chat/completions", {"messages": _MSG, "top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": _MSG, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": _MSG, "stream": True, "n": 3}, 400, "n"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [3]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": {"text": "x"}}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo"),
    # JSON may escape a lone surrogate, which no tokenizer takes
    ("/v1/completions", '{"prompt": "a\\ud800"}', 400, "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     "messages"),
    ("/v1/completions", {"prompt": "hello " * 1100}, 400, "prompt"),
    ("/v1/completions", {"prompt": list(range(1, 1025)), "stream": True}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [1] * 1000, "max_tokens": 30}, 400, "max_tokens"),
    # what jkv does not do is refused, never silently ignored
    ("/v1/chat/completions", {"messages": _MSG, "response_format": {"type": "json_object"}},
     400, "response_format"),
    ("/v1/chat/completions", {"messages": _MSG, "tools": [{"type": "function", "function": {
        "name": "f"}}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": _MSG, "tool_choice": "auto"}, 400, "tool_choice"),
]


@pytest.mark.parametrize("path, body, status, param", BAD,
                         ids=[f"{i}-{p.rsplit('/', 1)[-1]}" for i, (p, *_) in enumerate(BAD)])
def test_bad_request(srv, path, body, status, param):
    r = post(srv, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param
    if param is not None and param not in ("prompt",):
        assert param in err["message"]


def test_plain_text_format_and_no_tools_are_accepted(srv):
    body = {"messages": _MSG, "max_tokens": 2, "response_format": {"type": "text"},
            "tools": [], "tool_choice": "none"}
    assert post(srv, "/v1/chat/completions", body).status_code == 200


def test_unknown_model_and_route(srv):
    r = post(srv, "/v1/chat/completions", {"model": "gpt-4", "messages": _MSG})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        srv.client.completions.create(model="nope", prompt=PROMPT, max_tokens=1)
    assert srv.http.get(srv.base + "/v1/nowhere").status_code == 404
    assert srv.http.get(srv.base + "/v1/completions").status_code == 405
    with pytest.raises(openai.BadRequestError, match="n=1"):
        srv.client.chat.completions.create(model=srv.name, messages=CHAT, n=2)


def test_body_too_large(srv):
    big = json.dumps({"prompt": "a" * (1 << 20)})
    r = post(srv, "/v1/completions", big)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no content-length: chunked transfer encoding
        yield big[: len(big) // 2].encode()
        yield big[len(big) // 2:].encode()

    r = srv.http.post(srv.base + "/v1/completions", content=chunks(),
                      headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_internal_errors_are_json_500(srv, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    # an error in the handler
    with monkeypatch.context() as m:
        m.setattr(srv.llm, "submit", broken)
        r = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "server_error" and "boom" in err["message"]
    # an error in the scheduler loop's step fails the requests in flight, not the loop
    monkeypatch.setattr(srv.llm.engine, "step", broken)
    r = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    # streaming: headers are already out, so the error arrives as an event, then [DONE]
    r = post(srv, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "stream": True})
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_error"


def test_still_serving_after_errors(srv):
    assert srv.http.get(srv.base + "/health").json() == {"status": "ok"}
    r = srv.client.completions.create(model=srv.name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                      temperature=0)
    assert r.choices[0].text == library(srv, PROMPT).text


# ---------------------------------------------------------------------------- concurrency


def test_concurrent_streams(srv):
    prompts = [[{"role": "user", "content": c}] for c in
               ("Name a fruit.", "Say hello.", "What is 2+2?", "Name a planet.")]
    expected = [chat_greedy(srv, m) for m in prompts]
    results: list[str | BaseException | None] = [None] * len(prompts)

    def worker(i: int) -> None:
        try:
            stream = srv.client.chat.completions.create(
                model=srv.name, messages=prompts[i], max_tokens=MAX_TOKENS, temperature=0,
                stream=True)
            results[i] = "".join(c.choices[0].delta.content or "" for c in stream
                                 if c.choices)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            results[i] = e

    threads = [threading.Thread(target=worker, args=(i,), daemon=True)
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a streaming request did not finish"
    assert results == expected


def _spy_on_submits(srv, monkeypatch) -> list:
    """Record the scheduler requests of every generation the server submits."""
    handles: list = []
    real = srv.llm.submit

    def spy(*args, **kwargs):
        handles.append(real(*args, **kwargs))
        return handles[-1]

    monkeypatch.setattr(srv.llm, "submit", spy)
    return handles


def _wait_finished(srv, handles, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not (handles and all(h.finished for h in handles)):
        assert time.monotonic() < deadline, "the generation did not stop"
        time.sleep(0.05)
    stats = srv.llm.stats()
    while stats["num_requests_running"] or stats["num_requests_waiting"]:
        assert time.monotonic() < deadline, "requests still in flight"
        time.sleep(0.05)
        stats = srv.llm.stats()
    # idle: every page is free or holds a cached block nobody reads
    assert stats["kv_pages_used"] == stats["kv_pages_cached"]


def test_stream_disconnect_stops_generation(srv, monkeypatch):
    handles = _spy_on_submits(srv, monkeypatch)
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with srv.http.stream("POST", srv.base + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break  # one token arrived; hang up
    _wait_finished(srv, handles)
    (h,) = handles
    assert h.finish_reason == "abort" and len(h.output) < 100  # stopped soon after


def test_non_stream_disconnect_stops_generation(srv, monkeypatch):
    handles = _spy_on_submits(srv, monkeypatch)
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        srv.http.post(srv.base + "/v1/completions", json=body, timeout=1.5)
    _wait_finished(srv, handles)
    (h,) = handles
    assert h.finish_reason == "abort" and len(h.output) < 400
    # and the next request is served normally
    assert chat_greedy(srv, CHAT)


# ---------------------------------------------------------------------------- command line


def test_parser_flags_map_to_llm():
    args = build_parser().parse_args(["--port", "9000", "--max-model-len", "512",
                                      "--kv-cache-bytes", "1000000", "--dtype", "float32"])
    assert (args.host, args.port, args.model) == ("127.0.0.1", 9000, None)
    assert (args.max_model_len, args.kv_cache_bytes, args.dtype) == (512, 1000000, "float32")
    help_text = build_parser().format_help()
    for flag in ("--host", "--port", "--model", "--served-model-name", "--dtype",
                 "--max-model-len", "--attention-backend", "--kv-format", "--seed",
                 "--page-size", "--kv-cache-bytes", "--max-num-seqs", "--log-level",
                 "--enable-prefix-caching", "--device-cache-bytes", "--max-num-batched-tokens",
                 "--api-key", "--max-queue", "--request-timeout", "--drain-timeout"):
        assert flag in help_text


# ---------------------------------------------------------------------------- prefix reuse


def test_a_follow_up_turn_reuses_the_history_and_matches_a_server_without_the_cache(srv):
    turn1 = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
             {"role": "user", "content": "Tell me a short story about a robot who learns to "
                                         "paint, in three sentences."}]
    kw = dict(max_tokens=16, temperature=0)
    with serving(LLM(max_model_len=1024, max_num_seqs=4, enable_prefix_caching=False)) as off:
        for s in (srv, off):
            r1 = s.client.chat.completions.create(model=s.name, messages=turn1, **kw)
            turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                             {"role": "user", "content": "Now give the robot a name."}]
            before = s.llm.stats()["prefix_hit_tokens"]["device"]
            r2 = s.client.chat.completions.create(model=s.name, messages=turn2, **kw)
            s.hits = s.llm.stats()["prefix_hit_tokens"]["device"] - before
            s.replies = [r1.choices[0].message.content, r2.choices[0].message.content]
            s.history = len(s.llm.chat_prompt(turn1)) + r1.usage.completion_tokens - 1
    assert srv.replies == off.replies, "prefix caching changed the greedy tokens"
    assert off.hits == 0
    # every full page of the history whose KV was computed came from the device
    assert srv.hits >= srv.history // srv.llm.engine.page_size * srv.llm.engine.page_size > 0
    text = srv.http.get(srv.base + "/metrics").text
    assert 'jkv_prefix_cache_hit_tokens_total{tier="device"}' in text


# ---------------------------------------------------------------------------- operations


def test_metrics_endpoint_exports_the_serving_figures(srv):
    srv.client.completions.create(model=srv.name, prompt=PROMPT, max_tokens=4, temperature=0)
    text = srv.http.get(srv.base + "/metrics").text
    for name in ("jkv_time_to_first_token_seconds_bucket", "jkv_time_per_output_token_seconds",
                 "jkv_e2e_request_latency_seconds_count", "jkv_num_requests_running",
                 "jkv_num_requests_waiting", "jkv_kv_pages_used", "jkv_kv_pages_total",
                 "jkv_prefix_cache_query_tokens_total", "jkv_recomputed_tokens_total",
                 "jkv_preemptions_total", "jkv_compilations_total", "jkv_kv_pages_cached"):
        assert name in text, name
    assert "_created" not in text  # no twin series per counter
    total = [ln for ln in text.splitlines() if ln.startswith("jkv_kv_pages_total ")]
    assert float(total[0].split()[1]) == srv.llm.engine.cache.total_pages
    # the step costs the SLO checks weigh, learned from the decode steps just run
    costs = {ln.split('"')[1]: float(ln.split()[1]) for ln in text.splitlines()
             if ln.startswith("jkv_step_cost_seconds{")}
    assert set(costs) == {"decode", "decode_full", "prefill_token", "prefill_row",
                          "offload_layer"}
    assert costs["decode"] > 0 and costs["decode_full"] > 0 and costs["offload_layer"] >= 0


def test_api_key_guards_v1_routes_only_unless_metrics_require_it(srv):
    import asyncio

    def get(app, path: str, key: str | None):
        async def call():
            transport = httpx.ASGITransport(app=app)
            headers = {} if key is None else {"Authorization": f"Bearer {key}"}
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                return await c.get(path, headers=headers)
        return asyncio.run(call())

    app = build_app(srv.llm, api_key="sekrit")  # its loop is never started: no generation
    for key, status in ((None, 401), ("wrong", 401), ("sekrit", 200)):
        r = get(app, "/v1/models", key)
        assert r.status_code == status, (key, r.text)
        if status == 401:
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert get(app, "/health", None).status_code == 200
    assert get(app, "/metrics", None).status_code == 200
    strict = build_app(srv.llm, api_key="sekrit", metrics_require_key=True)
    for path in ("/metrics", "/openapi.json", "/docs", "/v1/models"):
        assert get(strict, path, None).status_code == 401, path
        assert get(strict, path, "sekrit").status_code == 200, path
    assert get(strict, "/health", None).status_code == 200  # liveness stays open
    assert get(strict, "/ready", None).status_code == 200  # and so does readiness


def test_the_api_key_comes_from_a_flag_a_file_or_the_environment(tmp_path):
    """--api-key, else --api-key-file's first line, else JKV_API_KEY; conflicting or empty
    sources, and --metrics-require-key without a key, are usage errors."""
    from jkv.server.flags import api_key

    def key(*argv: str, env: dict | None = None):
        return api_key(build_parser().parse_args(list(argv)), env or {})

    secret = tmp_path / "key"
    secret.write_text("from-file\nignored\n")
    assert key() is None
    assert key("--api-key", "flag") == "flag"
    assert key("--api-key-file", str(secret), env={"JKV_API_KEY": "env"}) == "from-file"
    assert key(env={"JKV_API_KEY": "env"}) == "env"
    (tmp_path / "empty").write_text("\n")
    for argv in (["--api-key", "a", "--api-key-file", str(secret)],
                 ["--api-key-file", str(tmp_path / "empty")],
                 ["--api-key-file", str(tmp_path / "missing")], ["--metrics-require-key"]):
        with pytest.raises(ValueError):
            key(*argv)
    assert key("--metrics-require-key", env={"JKV_API_KEY": "env"}) == "env"


def test_a_full_queue_is_a_503_with_retry_after(srv, monkeypatch):
    monkeypatch.setattr(srv.app.state.server.admission, "max_queue", 0)  # always full
    r = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full"


@pytest.mark.parametrize("field,value", [("priority", "high"), ("ttft_slo_ms", -5),
                                         ("tpot_slo_ms", 0), ("session_id", 7)])
def test_bad_extension_fields_are_400(srv, field, value):
    r = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_extension_fields_are_accepted(srv):
    r = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                      "session_id": "conv-1", "priority": -1,
                                      "ttft_slo_ms": 5000, "tpot_slo_ms": 1000})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------- hostile input



def _containers(inner):
    return st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                         max_size=3)


_ANY = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    _containers, max_leaves=6)
_FIELDS = {
    "model": st.none() | st.text(max_size=10),
    "max_tokens": st.integers(1, 3) | st.integers() | st.floats() | st.text(max_size=3),
    "temperature": st.floats(allow_nan=True) | st.integers(),
    "top_p": st.floats(allow_nan=True), "top_k": st.integers(-5, 10**20),
    "seed": st.integers(-10**20, 10**20), "stop": _ANY, "stream": st.booleans() | _ANY,
    "n": st.integers(-2, 4), "logprobs": _ANY, "stop_token_ids": _ANY, "ignore_eos": _ANY,
    "session_id": _ANY, "priority": st.integers(-10**7, 10**7) | _ANY,
    "ttft_slo_ms": st.floats(allow_nan=True) | _ANY, "tpot_slo_ms": _ANY,
    "stream_options": _ANY, "frobnicate": _ANY,
}
_TEXT = st.text(max_size=40) | st.just("") | st.just("word " * 1500) | st.text(
    alphabet=st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF), max_size=10)
_MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "robot"]) | _ANY,
     "content": _TEXT | _ANY}), max_size=3) | _ANY
_BODY = st.fixed_dictionaries({}, optional=_FIELDS)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(chat=st.booleans(), body=_BODY, prompt=_TEXT | st.lists(st.integers(), max_size=4)
       | _ANY, messages=_MESSAGES, raw=st.none() | st.binary(max_size=40))
def test_hostile_bodies_get_a_4xx_json_error_or_a_valid_completion(srv, chat, body, prompt,
                                                                  messages, raw):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    n = body.setdefault("max_tokens", 2)
    if isinstance(n, int) and 3 < n < 1024:
        body["max_tokens"] = 3  # valid counts stay small so the test stays short
    body["messages" if chat else "prompt"] = messages if chat else prompt
    try:
        r = post(srv, path, raw if raw is not None else json.dumps(body, allow_nan=True),
                 timeout=60)
    except httpx.ReadTimeout:
        pytest.fail(f"no answer within 60 s for {body!r}")
    assert r.status_code in (200, 400, 404, 413, 422), (r.status_code, r.text[:300])
    if r.status_code != 200:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"]
        return
    if "text/event-stream" in r.headers["content-type"]:
        events = sse_events(r)
        assert events[-1] == "[DONE]"
        for e in events[:-1]:
            assert "error" not in json.loads(e), e
    else:
        out = r.json()
        (choice,) = out["choices"]
        assert choice["finish_reason"] in ("stop", "length")
        assert out["usage"]["completion_tokens"] <= 3


def test_healthy_after_hostile_bodies(srv):
    assert srv.http.get(srv.base + "/health").json() == {"status": "ok"}
    stats = srv.llm.stats()
    assert stats["num_requests_running"] == 0 and stats["requests_aborted"] >= 0


# ---------------------------------------------------------------------------- load


def _idle(srv, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = srv.llm.stats()
        if not (stats["num_requests_running"] or stats["num_requests_waiting"]):
            return stats
        assert time.monotonic() < deadline, "requests still in flight"
        time.sleep(0.05)


def test_32_concurrent_streams_complete_and_pages_return(srv):
    messages = [[{"role": "user", "content": f"Count to {i % 5 + 2}."}] for i in range(32)]
    results: list = [None] * 32

    def worker(i: int) -> None:
        try:
            stream = srv.client.chat.completions.create(
                model=srv.name, messages=messages[i], max_tokens=6, temperature=0, stream=True)
            chunks = list(stream)
            results[i] = (chunks[-1].choices[0].finish_reason,
                          "".join(c.choices[0].delta.content or "" for c in chunks))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            results[i] = e

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a stream did not finish in 300 s"
    assert all(isinstance(r, tuple) and r[0] in ("stop", "length") and r[1] for r in results), \
        results
    stats = _idle(srv)
    assert stats["kv_pages_used"] == stats["kv_pages_cached"]


def test_memory_stays_flat_over_300_requests(srv):
    import concurrent.futures
    import resource

    def one(i: int) -> int:
        r = post(srv, "/v1/completions", {"prompt": f"Item {i % 50}: the", "max_tokens": 1,
                                          "temperature": 0})
        return r.status_code

    def rss_mb() -> float:  # this process: the server runs in it
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert set(pool.map(one, range(100))) == {200}  # warm: every shape compiled
        before = rss_mb()
        assert set(pool.map(one, range(100, 300))) == {200}
    grown = rss_mb() - before
    stats = _idle(srv)
    assert stats["kv_pages_used"] == stats["kv_pages_cached"]
    # 200 requests: a leak of 50 KB per request would show as 10 MB
    assert grown < 10, f"RSS grew {grown:.1f} MB over 200 requests"


# ---------------------------------------------------------------------------- logprobs


def test_chat_logprobs_stream_and_non_stream(srv):
    kw = dict(model=srv.name, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
              top_logprobs=3)
    r = srv.client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # greedy: the chosen token is the most likely one
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(tops[0], abs=1e-5)
    stream = srv.client.chat.completions.create(**kw, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == \
        [(e.token, round(e.logprob, 4)) for e in content]


def test_completion_logprobs(srv):
    r = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                      "logprobs": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                               strict=True):
        assert len(top) == 2 and top[tok] == pytest.approx(value)
    assert "".join(lp["tokens"]) == choice["text"]


def test_a_request_past_its_deadline_is_a_503(srv, monkeypatch):
    monkeypatch.setattr(srv.app.state.server, "request_timeout", 1e-3)
    r = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 50, "ignore_eos": True})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "deadline_exceeded"
    assert _idle(srv)["num_requests_running"] == 0


def test_sigterm_drains_then_exits(tmp_path):
    import signal
    import subprocess
    import sys

    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    number = port.getsockname()[1]
    port.close()
    proc = subprocess.Popen([sys.executable, "-m", "jkv.server", "--port", str(number),
                             "--max-model-len", "512", "--drain-timeout", "2",
                             "--log-level", "warning"])
    base = f"http://127.0.0.1:{number}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "the server exited during start-up"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        proc.send_signal(signal.SIGTERM)  # mid-stream
        t_signal = time.monotonic()
        # the stream ended (aborted after the 2 s drain) and the process exits soon after
        assert events[-1] == "[DONE]" and len(events) < 400
        # uvicorn re-raises the signal once it has shut down, so the exit status says SIGTERM;
        # the [DONE] above shows the response was ended by the drain, not cut by a kill
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        assert time.monotonic() - t_signal < 30
    finally:
        if proc.poll() is None:
            proc.kill()


# ---------------------------------------------------------------------------- the schema


def tiny_chat_model(path) -> None:
    """A random two-layer Llama with SmolLM2's tokenizer and chat template, saved as an HF
    directory: the server's API at a fraction of the real model's compute."""
    import torch
    import transformers

    from jkv.models.loaders import default_model_path

    src = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)


@pytest.mark.long
def test_the_published_schema_is_what_the_server_does(tmp_path):
    """schemathesis over the served /openapi.json with every check: documented statuses,
    content types and bodies, schema-violating bodies refused, no 5xx, the server up
    throughout. The server is `python -m jkv.server` in its own process, bounded: a tiny
    random model with the embedded one's tokenizer (the schema is the API's, not the
    model's), a short context (40 tokens: a chat's template takes 30, so a reply is short),
    5 examples per operation, a fixed seed, no background warm-up competing with the
    requests. One check is left out: positive_data_acceptance, because a schema cannot state
    the one limit that depends on the prompt's tokenization (prompt tokens + max_tokens within
    max_model_len: a documented 400); the 400s of schema constraints are checked from the
    other side by negative_data_rejection."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    cli = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or shutil.which(
        "schemathesis")
    if cli is None:
        pytest.skip("schemathesis is not installed (the dev extra has it)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"  # (a pipe would fill with the request log and stall it)
    tiny_chat_model(tmp_path / "tiny")
    # What the server compiles goes to the run's cache, not the user's; the code it runs is
    # the jkv this test imported (not an installed copy elsewhere).
    import jkv

    path = os.pathsep.join(filter(None, [str(Path(jkv.__file__).parents[1]),
                                         os.environ.get("PYTHONPATH")]))
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "jkv.server", "--model", str(tmp_path / "tiny"), "--port",
             str(port), "--max-model-len", "40", "--max-num-seqs", "4", "--no-precompile",
             "--compilation-cache-dir", os.environ.get("JAX_COMPILATION_CACHE_DIR", "")],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": path})
    try:
        wait_until_healthy(base, lambda: None if server.poll() is None
                           else log.read_text()[-3000:], 300)
        done = subprocess.run(
            [cli, "run", f"{base}/openapi.json", "--checks", "all",
             "--exclude-checks", "positive_data_acceptance", "--max-examples", "5",
             "--seed", "1", "--request-timeout", "120", "--max-response-time", "120",
             "--no-color"],
            capture_output=True, text=True, timeout=900, cwd=tmp_path)
        assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200  # still up
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_server_slo_defaults_apply_to_requests_that_set_none():
    with serving(LLM(max_model_len=128, max_num_seqs=2), ttft_slo_ms=1e-6,
                 tpot_slo_ms=3.6e6) as s:
        body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
        assert post(s, "/v1/completions", body).status_code == 200  # the defaults: ttft missed
        assert post(s, "/v1/completions", {**body, "ttft_slo_ms": 3.6e6}).status_code == 200
        stats = s.llm.stats()
        assert stats["slo_violations"] == {"ttft": 1, "tpot": 0}
        assert stats["requests_within_slo"] == 1  # its own target, an hour, kept
        text = s.http.get(s.base + "/metrics").text
        assert 'jkv_slo_violations_total{kind="ttft"} 1.0' in text
