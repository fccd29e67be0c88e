"""The OpenAI-compatible server, in-process over real SmolLM2 weights, through real clients."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from types import SimpleNamespace

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from jkv import LLM, SamplingParams  # noqa: E402
from jkv.server import build_app, build_parser  # noqa: E402

pytestmark = pytest.mark.smollm2

MAX_TOKENS = 8
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name one color of the rainbow."}]


@pytest.fixture(scope="module")
def srv():
    llm = LLM(max_model_len=1024, max_num_seqs=4)
    app = build_app(llm)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert thread.is_alive(), "the server thread died"
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up within 60 s"
        time.sleep(0.1)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
    yield SimpleNamespace(llm=llm, app=app, base=base, client=client,
                          name=app.state.served_model_name, http=httpx.Client(timeout=120))
    server.should_exit = True
    thread.join(timeout=30)
    sock.close()


def post(srv, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, bytes | str):
        return srv.http.post(srv.base + path, content=body,
                             headers={"content-type": "application/json"}, **kw)
    return srv.http.post(srv.base + path, json=body, **kw)


def library(srv, prompt, max_tokens: int = MAX_TOKENS):
    """Greedy output of the LLM called directly (under the server's lock)."""
    with srv.app.state.lock:
        return srv.llm.generate(prompt, SamplingParams(max_tokens=max_tokens,
                                                       temperature=0))[0]


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
    # the library's own chat gives the same greedy reply
    with srv.app.state.lock:
        direct = srv.llm.chat(CHAT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert choice.message.content == direct.text


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
    ("/v1/chat/completions", {"messages": _MSG, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": _MSG, "top_k": -2}, 400, "top_k"),
    ("/v1/chat/completions", {"messages": _MSG, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/chat/completions", {"messages": _MSG, "stop": ""}, 400, "stop"),
    ("/v1/chat/completions", {"messages": _MSG, "logprobs": True}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": _MSG, "stream": True, "n": 3}, 400, "n"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [3]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": {"text": "x"}}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo"),
    ("/v1/completions", {"prompt": "hello " * 1100}, 400, "prompt"),
    ("/v1/completions", {"prompt": list(range(1, 1025)), "stream": True}, 400, "prompt"),
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

    monkeypatch.setattr(srv.llm, "run", broken)
    r = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and "boom" in err["message"]
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


def _spy_on_runs(srv, monkeypatch) -> list:
    """Record the trackers of every generation the server runs."""
    runs: list = []
    real = srv.llm.run

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        runs.extend(out)
        return out

    monkeypatch.setattr(srv.llm, "run", spy)
    return runs


def _wait_idle(srv, timeout: float = 60) -> None:
    assert srv.app.state.lock.acquire(timeout=timeout), "the generation did not stop"
    srv.app.state.lock.release()


def test_stream_disconnect_stops_generation(srv, monkeypatch):
    runs = _spy_on_runs(srv, monkeypatch)
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with srv.http.stream("POST", srv.base + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break  # one token arrived; hang up
    time.sleep(0.5)
    _wait_idle(srv)
    for _ in range(50):  # the tracker list is filled once run() returns
        if runs:
            break
        time.sleep(0.1)
    assert len(runs) == 1 and len(runs[0].token_ids) < 100  # stopped soon after the hang-up


def test_non_stream_disconnect_stops_generation(srv, monkeypatch):
    runs = _spy_on_runs(srv, monkeypatch)
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        srv.http.post(srv.base + "/v1/completions", json=body, timeout=1.5)
    _wait_idle(srv)
    for _ in range(50):
        if runs:
            break
        time.sleep(0.1)
    assert len(runs) == 1 and len(runs[0].token_ids) < 400
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
                 "--page-size", "--kv-cache-bytes", "--max-num-seqs", "--log-level"):
        assert flag in help_text
