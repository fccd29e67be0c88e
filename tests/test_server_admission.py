"""The server's admission, in-process over SmolLM2: body limits refused before any
tokenizing, tokenization counted in /metrics, the queue limit and the deadline, cancelled
when its client goes away, GET /ready, and a plain request answered promptly beside two
10,000-message sessions."""

from __future__ import annotations

import logging
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from test_server import _spy_on_submits, post, serving  # noqa: E402

from jkv import LLM  # noqa: E402
from jkv.server.admission import MAX_PROMPT_CHARS, Limits  # noqa: E402

pytestmark = pytest.mark.smollm2

BLOCK = "a prompt whose tokenizing waits for the test"
GONE = "client went away while its prompt was made"


@pytest.fixture(scope="module")
def srv():
    with serving(LLM(max_model_len=256, max_num_seqs=4)) as s:
        s.server = s.app.state.server
        yield s


def until(check, seconds: float = 20, what: str = "the condition") -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds} s"
        time.sleep(0.02)


def block_tokenizing(srv, monkeypatch) -> threading.Event:
    """Completions whose prompt is BLOCK wait in the tokenizer pool until the event is set."""
    release, real = threading.Event(), srv.llm.encode

    def encode(prompt):
        if prompt == BLOCK:
            assert release.wait(60), "the test never released the tokenizer"
        return real(prompt)

    monkeypatch.setattr(srv.llm, "encode", encode)
    return release


def in_thread(fn, *args, **kw) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args, **kw)), daemon=True)
    t.start()
    return t, out


def occupy_the_pool(srv, monkeypatch) -> tuple[threading.Event, list]:
    """Both tokenizer threads held by BLOCK completions; returns the release and threads."""
    release = block_tokenizing(srv, monkeypatch)
    blockers = [in_thread(post, srv, "/v1/completions", {"prompt": BLOCK, "max_tokens": 1})
                for _ in range(2)]
    until(lambda: srv.server.admission.tokenizing == 2, what="two requests tokenizing")
    return release, blockers


def chat(n: int, session: str | None = None, text: str = "message number {} of the chat",
         **body) -> dict:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": text.format(i)}
                for i in range(n)]
    return {"messages": messages, "session_id": session, "temperature": 0, **body}


def test_limits_are_400s_naming_the_field_before_anything_is_tokenized(srv, monkeypatch):
    monkeypatch.setattr(srv.server.admission, "limits", Limits(max_messages=4,
                                                               max_prompt_chars=400))
    encodes: list = []
    real = srv.llm.tokenizer.encode
    monkeypatch.setattr(srv.llm.tokenizer, "encode",
                        lambda *a, **kw: encodes.append(1) or real(*a, **kw))
    for body, param, flag in (
            (chat(5), "messages", "--max-messages"),
            (chat(5, session="s"), "messages", "--max-messages"),
            (chat(1, text="x" * 401), "messages", "--max-prompt-chars"),
            (chat(1, text="x" * 390), "messages", "max_chars=400"),  # its template's text
            (chat(1, session="s", text="x" * 390), "messages", "max_chars=400")):
        r = post(srv, "/v1/chat/completions", {**body, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert flag in r.json()["error"]["message"]
    r = post(srv, "/v1/completions", {"prompt": "x" * 401, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert encodes == []
    assert post(srv, "/v1/chat/completions", {**chat(4), "max_tokens": 2}).status_code == 200


def test_tokenizing_requests_show_in_metrics_ready_and_the_queue_limit(srv, monkeypatch):
    monkeypatch.setattr(srv.server.admission, "max_queue", 2)
    release, blockers = occupy_the_pool(srv, monkeypatch)
    try:
        assert "jkv_num_requests_tokenizing 2.0" in srv.http.get(srv.base + "/metrics").text
        r = srv.http.get(srv.base + "/ready")
        assert r.status_code == 503 and r.json()["status"] == "queue_full", r.text
        r = post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
    finally:
        release.set()
    for t, out in blockers:
        t.join(60)
        assert out[0].status_code == 200, out[0].text
    assert srv.http.get(srv.base + "/ready").json() == {"status": "ready", "reason": None}
    assert "jkv_num_requests_tokenizing 0.0" in srv.http.get(srv.base + "/metrics").text


def test_tokenizing_counts_in_the_request_timeout(srv, monkeypatch):
    monkeypatch.setattr(srv.server, "request_timeout", 0.5)
    release = block_tokenizing(srv, monkeypatch)
    handles = _spy_on_submits(srv, monkeypatch)
    t0 = time.monotonic()
    r = post(srv, "/v1/completions", {"prompt": BLOCK, "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "deadline_exceeded", r.text
    assert time.monotonic() - t0 < 3
    release.set()
    until(lambda: srv.server.admission.tokenizing == 0)
    assert handles == []  # never submitted


def test_a_gone_client_s_tokenization_is_skipped_if_not_begun(srv, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="jkv.server")
    release, blockers = occupy_the_pool(srv, monkeypatch)
    calls: list = []
    real = srv.llm.session_prompt
    monkeypatch.setattr(srv.llm, "session_prompt",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    handles = _spy_on_submits(srv, monkeypatch)
    try:
        with pytest.raises(httpx.ReadTimeout):  # it waits for the pool; the client hangs up
            post(srv, "/v1/chat/completions", chat(2000, session="gone-early", max_tokens=2),
                 timeout=0.5)
        until(lambda: GONE in caplog.text, what="the server seeing the client gone")
    finally:
        release.set()
    for t, out in blockers:
        t.join(60)
        assert out[0].status_code == 200
    until(lambda: srv.server.admission.tokenizing == 0)
    assert calls == [] and len(handles) == 2  # only the two blockers ran


def test_a_gone_client_s_running_truncation_stops_between_renders(srv, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="jkv.server")
    body = chat(2000, session="gone-late", max_tokens=2)
    renders: list = []
    real = srv.llm._template_ids

    def slow(*a, **kw):
        renders.append(1)
        time.sleep(0.6)
        return real(*a, **kw)

    monkeypatch.setattr(srv.llm, "_template_ids", slow)
    srv.llm.session_prompt(body["messages"], 2)
    needed, renders[:] = len(renders), []
    assert needed >= 6
    handles = _spy_on_submits(srv, monkeypatch)
    with pytest.raises(httpx.ReadTimeout):
        post(srv, "/v1/chat/completions", body, timeout=0.6)
    until(lambda: GONE in caplog.text, what="the server seeing the client gone")
    until(lambda: srv.server.admission.tokenizing == 0, what="the truncation stopping")
    assert len(renders) <= 4 < needed and handles == []


def test_ready_says_why_it_would_refuse_work_and_health_stays_liveness(srv, monkeypatch):
    r = srv.http.get(srv.base + "/ready")
    assert r.status_code == 200 and r.json() == {"status": "ready", "reason": None}
    with monkeypatch.context() as m:
        m.setattr(LLM, "serving", property(lambda self: False))
        r = srv.http.get(srv.base + "/ready")
        assert r.status_code == 503 and r.json()["status"] == "starting"
        assert srv.http.get(srv.base + "/health").status_code == 200
    srv.server.closing.set()
    try:
        r = srv.http.get(srv.base + "/ready")
        assert r.status_code == 503 and r.json()["status"] == "draining", r.text
    finally:
        srv.server.closing.clear()
    assert srv.http.get(srv.base + "/ready").status_code == 200


def test_a_plain_request_answers_promptly_beside_two_10000_message_sessions(srv,
                                                                           monkeypatch):
    """The acceptance check of admission: with two 10,000-message sessions in flight (their
    truncation linear in the history, on the two tokenizer threads) a plain request reaches
    the scheduler within a few seconds of its arrival, so it answers within a few seconds of
    its own compute (its time in the scheduler, which it shares with the sessions' prompts
    as any batch does)."""
    monkeypatch.setattr(srv.server.admission, "limits",
                        Limits(max_messages=20_000, max_prompt_chars=MAX_PROMPT_CHARS))
    begun: list = []
    real = srv.llm.session_prompt
    monkeypatch.setattr(srv.llm, "session_prompt",
                        lambda *a, **kw: begun.append(1) or real(*a, **kw))
    submitted: dict = {}
    real_submit = srv.llm.submit

    def submit(*a, **kw):
        handle = real_submit(*a, **kw)
        submitted[handle.session_id] = (handle, time.monotonic())
        return handle

    monkeypatch.setattr(srv.llm, "submit", submit)
    sessions = [in_thread(post, srv, "/v1/chat/completions",
                          chat(10_000, session=f"long-{k}", max_tokens=1,
                               text=f"chat {k}: message number {{}}"))
                for k in range(2)]
    until(lambda: len(begun) == 2, what="both sessions' truncation begun")
    r = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                           "max_tokens": 4, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    for t, out in sessions:
        t.join(60)
        assert out[0].status_code == 200, out[0].text
    assert set(submitted) == {None, "long-0", "long-1"}
    plain, at = submitted[None]
    waited, took = at - plain.arrival, plain.finish_time - plain.arrival
    assert waited < 5, f"the plain request waited {waited:.1f} s of its {took:.1f} s to start"
