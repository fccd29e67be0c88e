"""jkv on Ray Serve (the `cluster` extra): one command starts 2 replicas behind one address,
and the `openai` client's checks give there what they give against `python -m jkv.server`;
in process (without Ray), a replica serves through the server's own app, and the ingress
hashes a prompt as the replica's store holds it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from jkv.cluster.asgi import RoutedRequest  # noqa: E402
from jkv.cluster.ingress import Hasher  # noqa: E402
from jkv.cluster.replica import Replica  # noqa: E402
from jkv.cluster.routing import ACTIVE_S, HASH_BYTES  # noqa: E402

pytestmark = pytest.mark.smollm2
CHAT = [{"role": "user", "content": "Name one color of the rainbow."}]
SMALL = ["--max-model-len", "512", "--max-num-seqs", "2", "--no-precompile"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client_checks(base: str) -> dict:
    """What a client sees: the model list, a greedy chat, the same streamed, a completion,
    and the error a bad request gets."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=180)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8,
                                          temperature=0)
    stream = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8,
                                            temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    text = client.completions.create(model=model, prompt="The capital of France is",
                                     max_tokens=6, temperature=0).choices[0].text
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model, messages=[], max_tokens=4)
    return {"model": model, "chat": chat.choices[0].message.content, "streamed": streamed,
            "completion": text, "error": (bad.value.status_code, bad.value.body)}


def start(module: str, port: int, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-m", module, "--port", str(port), *SMALL,
                             *extra], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_healthy(proc: subprocess.Popen, base: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise AssertionError(f"{base} did not come up within {seconds} s")


def stop(proc: subprocess.Popen, seconds: float) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def ask(base: str, model: str, session: str, messages: list) -> tuple[str, dict]:
    body = {"model": model, "messages": messages, "max_tokens": 2, "temperature": 0,
            "session_id": session}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.headers["x-jkv-replica"], r.json()


def turn_messages(session: str, turn: int) -> list:
    return [{"role": "user", "content": f"Say {turn} to {session}."}] * 8


def session_turns(base: str, model: str) -> tuple[dict, dict]:
    """Four sessions of two turns each, one request at a time: the replica and answer of
    each turn."""
    first = {s: ask(base, model, s, turn_messages(s, 1)) for s in ("a", "b", "c", "d")}
    time.sleep(2.5)  # the replicas report their sessions every second
    return first, {s: ask(base, model, s, turn_messages(s, 2)) for s in first}


def next_turns(base: str, model: str, second: dict) -> dict[str, tuple[float, float]]:
    """Each session's third turn (its second turn, the answer and one more question), after
    the replica that held it was killed: the share of its prompt read from a cache, and
    the share read from the shared store (where the replica's own memory is gone)."""
    shares = {}
    for session, (_, answer) in second.items():
        messages = turn_messages(session, 2) + [answer["choices"][0]["message"],
                                       {"role": "user", "content": "Say 3."}]
        usage = ask(base, model, session, messages)[1]["usage"]
        details = usage["prompt_tokens_details"]
        shares[session] = (details["cached_tokens"] / usage["prompt_tokens"],
                           details["cached_tokens_by_tier"]["disk"] / usage["prompt_tokens"])
    return shares


@pytest.mark.long
def test_two_replicas_answer_the_client_as_the_server_does_and_keep_sessions(tmp_path):
    """One command starts 2 replicas sharing one store; the client's checks give what they
    give against `python -m jkv.server`; each session's second turn goes where its first
    went (Serve's default router, tried in place of the KV-aware one, moved one of four); a
    replica killed mid-stream ends its client's stream at once and the next request is
    answered; the next turns of every session find their history cached, those of the
    killed replica's sessions in the shared store. One Ray instance at a time: a second
    local cluster would join the first."""
    pytest.importorskip("ray.serve")
    results = {}
    for module, extra in [("jkv.server", ()), ("jkv.cluster", (
            "--replicas", "2", "--ray-cpus", "2", "--store-dir", str(tmp_path)))]:
        port = free_port()
        proc = start(module, port, *extra)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(proc, base, 240)
            results[module] = client_checks(base)
            if module == "jkv.cluster":
                model = results[module]["model"]
                first, second = session_turns(base, model)
                killed = kill_mid_stream(base, model, "a")
                shares = next_turns(base, model, second)
        finally:
            stop(proc, 90)  # SIGTERM: the cluster takes Serve and its local Ray down
    assert results["jkv.cluster"] == results["jkv.server"]
    assert {s: r for s, (r, _) in second.items()} == {s: r for s, (r, _) in first.items()}
    assert killed["stream"] in ("error", "cut short") and killed["seconds"] < 30
    assert killed["after"] == 200
    assert second["a"][0].endswith(f":{killed['pid']}")  # (its session's replica)
    assert min(cached for cached, _ in shares.values()) > 0.5, shares
    lost = [s for s, (replica, _) in second.items() if replica == second["a"][0]]
    assert min(shares[s][1] for s in lost) > 0.5, shares  # (from the shared store)


def kill_mid_stream(base: str, model: str, session: str) -> dict:
    """SIGKILL the replica streaming a long answer (of `session`: the replica holding it)
    once its first part arrived: the client's stream ends with an error or cut short, never
    hangs; a request after it is answered (by the other replica, or the one Serve starts in
    its place)."""
    body = {"model": model, "messages": CHAT, "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True, "session_id": session}
    t0, outcome = time.monotonic(), "finished"
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body,
                          timeout=60) as r:
            pid = int(r.headers["x-jkv-replica"].rsplit(":", 1)[1])
            parts = r.iter_lines()
            next(parts)
            os.kill(pid, signal.SIGKILL)
            lines = list(parts)
            outcome = "finished" if any("[DONE]" in x for x in lines) else "cut short"
    except httpx.HTTPError:
        outcome = "error"
    seconds = time.monotonic() - t0
    after = None
    for _ in range(60):
        try:
            after = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
                "model": model, "messages": CHAT, "max_tokens": 2}).status_code
        except httpx.HTTPError:
            after = None
        if after == 200:
            break
        time.sleep(1)
    return {"stream": outcome, "seconds": seconds, "after": after, "pid": pid}


@pytest.mark.parametrize("held", ["store", "device prefix cache"])
def test_a_replica_serves_through_the_servers_app_and_reports_what_it_holds(held):
    options = {"max_model_len": 512, "max_num_seqs": 2}
    if held != "store":  # no store: what it reports is its device prefix cache's
        options |= {"host_cache_bytes": 0, "enable_prefix_caching": True}

    async def run() -> tuple:
        replica = Replica(options, {})
        body = {"model": replica.app.state.served_model_name, "messages": CHAT * 12,
                "max_tokens": 4, "temperature": 0, "session_id": "chat-7"}
        keys = Hasher(replica.info()).keys(body)  # as the ingress routes it
        request = RoutedRequest("POST", "/v1/chat/completions",
                                headers=[(b"content-type", b"application/json")],
                                body=json.dumps(body).encode(), **keys)
        parts = [p async for p in replica.handle(request)]
        bad = [p async for p in replica.handle(RoutedRequest(
            "POST", "/v1/chat/completions", headers=[(b"content-type", b"application/json")],
            body=b"{not json"))]
        for _ in range(100):  # (the store's writer saves the finished request)
            if replica.record_routing_stats()["blocks"]:
                break
            await asyncio.sleep(0.1)
        stats = replica.record_routing_stats()
        await replica.close()
        return parts, bad, stats, keys

    parts, bad, stats, keys = asyncio.run(run())
    assert parts[0][:2] == ("start", 200)
    answer = json.loads(b"".join(p[1] for p in parts[1:]))
    assert answer["choices"][0]["finish_reason"] == "length"
    assert bad[0][1] == 400 and b"error" in b"".join(p[1] for p in bad[1:])
    assert stats["queue"] == 0 and "chat-7" in stats["sessions"] and stats["active"] == 1
    # the ingress's hashes of the prompt are those the replica holds its KV under
    assert keys["session"] == "chat-7" and len(keys["hashes"]) >= 4
    assert {h[:HASH_BYTES] for h in keys["hashes"]} <= set(stats["blocks"])


def test_active_sessions_are_those_served_in_the_last_minute():
    """What the router places new conversations by: sessions served in the last ACTIVE_S
    seconds (the latest are last), not every session remembered."""
    from collections import OrderedDict

    replica = Replica.__new__(Replica)  # (no engine: only the sessions' times)
    now = time.monotonic()
    replica._sessions = OrderedDict([("gone", now - ACTIVE_S - 5), ("old", now - ACTIVE_S - 1),
                                     ("a", now - ACTIVE_S / 2), ("b", now)])
    assert replica._active() == 2


def test_the_ingress_refuses_a_body_over_the_limit_before_reading_it():
    from jkv.cluster.ingress import build_ingress
    from jkv.server.guard import MAX_BODY_BYTES

    async def no_hasher():
        raise AssertionError("a refused body is never hashed")

    app = build_ingress(None, no_hasher)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x")
    r = asyncio.run(client.post("/v1/chat/completions",
                                content=b"{" + b" " * MAX_BODY_BYTES + b"}"))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_a_replica_routes_by_what_it_alone_holds():
    """An entry of a store tier every replica shares is as near to each: only host-tier
    entries (and a private disk's) draw requests to the replica holding them."""
    from types import SimpleNamespace

    def store(coordinator, where):
        return SimpleNamespace(p=SimpleNamespace(shared=coordinator is not None),
                               placement=SimpleNamespace(where=lambda key: where))

    assert Replica._own(store("127.0.0.1:1", "host"), "k")
    assert not Replica._own(store("127.0.0.1:1", "disk"), "k")
    assert Replica._own(store(None, "disk"), "k")  # a disk it alone reads
