"""The faults `chaos.py` injects into a jkv server with a KV store, each a function of the run
(`Chaos`) returning what it observed and whether the server held. What "held" means is
fixed here, before any run:

- kill -9 (mid-stream, with a save in flight, idle): the server restarts on the same store
  and the next turns are answered correctly (checked by the caller's turns).
- a full disk: with a ballast file leaving the store's filesystem nearly full, turns are
  still answered correctly; once the ballast is gone, saves resume (the saves counter rises).
- a damaged manifest: the damaged bytes are kept in a sibling folder of the store and the
  restarted server answers.
- damaged data files: the restarted server answers correctly (corrupt entries are misses).
- aborted streams: every request ends and the device pages not kept for reuse come back.
- hostile bodies: each gets a 4xx JSON error and the server stays healthy.
- a 10,000-message session chat in flight: a plain request answers within
  `PLAIN_REQUEST_SECONDS` plus its own time measured alone.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from pathlib import Path

import httpx

PLAIN_REQUEST_SECONDS = 10.0
DISK_HEADROOM = 256 * 1024  # what the ballast leaves free on the store's filesystem


def _flip_bytes(path: Path, rng: random.Random, count: int = 8) -> None:
    data = bytearray(path.read_bytes())
    if not data:
        return
    for _ in range(count):
        i = rng.randrange(len(data))
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _store_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def kill_mid_stream(run) -> dict:
    """SIGKILL while a reply streams (the server may be saving the blocks it filled)."""
    events = []

    def stream() -> None:
        body = run.turn_body(run.pick_chat(), stream=True)
        try:
            with httpx.stream("POST", run.server.base + "/v1/chat/completions", json=body,
                              timeout=120) as r:
                for line in r.iter_lines():
                    events.append(line)
        except httpx.HTTPError:
            pass  # the kill cuts it: expected

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 120
    while len(events) < 3 and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    run.server.kill9()
    t.join(60)
    run.server.start()
    return {"held": True, "events_before_kill": len(events)}


def kill_after_reply(run) -> dict:
    """SIGKILL a moment after a reply ends, while the store writes its blocks."""
    delay = run.rng.uniform(0, 0.5)
    run.one_turn(run.pick_chat())
    time.sleep(delay)
    run.server.kill9()
    run.server.start()
    return {"held": True, "delay_s": round(delay, 3)}


def kill_idle(run) -> dict:
    """SIGKILL once the store has had time to write everything."""
    time.sleep(3)
    run.server.kill9()
    run.server.start()
    return {"held": True}


def disk_fills(run) -> dict:
    """Fill the store's filesystem to DISK_HEADROOM, run turns, then free it: held when
    entries reach the disk again or its budget is back (the host tier may need no room)."""
    if run.tmpfs is None:
        return {"skipped": "the store is not on a size-limited filesystem (needs root)"}
    ballast = run.tmpfs / "ballast"
    before = run.server.metrics()
    free = os.statvfs(run.tmpfs).f_bavail * os.statvfs(run.tmpfs).f_frsize
    with open(ballast, "wb") as f:
        f.truncate(0)
        chunk = b"\0" * (1 << 20)
        left = max(0, free - DISK_HEADROOM)
        while left > 0:
            n = min(left, len(chunk))
            try:
                f.write(chunk[:n])
                f.flush()
            except OSError:
                break
            left -= n
    full = run.server.metrics()
    for _ in range(run.args.concurrency * 2):
        run.one_turn(run.pick_chat())
    ballast.unlink()
    mid = run.server.metrics()
    after, written = mid, "jkv_store_offloads_total"  # entries the host tier moved to disk
    for _ in range(4):  # turns until one reaches the disk again (the host tier fills first)
        for _ in range(run.args.concurrency * 2):
            run.one_turn(run.pick_chat())
        time.sleep(2)
        after = run.server.metrics()
        if after.get(written, 0) > mid.get(written, 0):
            break
    failures = {k: after.get(k, 0) - full.get(k, 0) for k in after
                if k.startswith("jkv_store_") and ("fail" in k or "dropped" in k)}
    budget = 'jkv_store_capacity_bytes{tier="disk"}'  # lowered when full, back once freed
    return {"held": (after.get(written, 0) > mid.get(written, 0)
                     or after.get(budget, 0) >= before.get(budget, 0) > 0),
            "disk_budget": [before.get(budget, 0), mid.get(budget, 0), after.get(budget, 0)],
            "disk_full_events": mid.get("jkv_store_disk_full_total", 0)
            - full.get("jkv_store_disk_full_total", 0),
            "to_disk_while_full": mid.get(written, 0) - full.get(written, 0),
            "to_disk_after_freeing": after.get(written, 0) - mid.get(written, 0),
            "failure_counters": failures}


def manifest_damage(run) -> dict:
    """Flip bytes of the store's manifest while the server is down; the restarted server
    must answer and the damaged bytes must survive beside the store."""
    run.server.kill9()
    manifests = [p for p in _store_files(run.store_dir) if p.name.startswith("manifest")]
    if not manifests:
        run.server.start()
        return {"skipped": "no manifest written yet"}
    _flip_bytes(manifests[0], run.rng)
    digest = hashlib.sha256(manifests[0].read_bytes()).hexdigest()
    run.server.start()
    siblings = [p for p in run.store_dir.parent.iterdir()
                if p.is_dir() and p != run.store_dir and p.name.startswith(run.store_dir.name)]
    kept = any(hashlib.sha256(f.read_bytes()).hexdigest() == digest
               for s in siblings for f in _store_files(s) if f.name.startswith("manifest"))
    for s in siblings:  # an operator's clean-up, so the next damage starts afresh
        for f in sorted(s.rglob("*"), reverse=True):
            f.unlink() if f.is_file() else f.rmdir()
        s.rmdir()
    return {"held": kept, "damaged_bytes_kept_aside": kept, "siblings": len(siblings)}


def data_damage(run) -> dict:
    """Flip bytes in, or truncate, some of the store's data files while it is down."""
    run.server.kill9()
    data = [p for p in _store_files(run.store_dir) if not p.name.startswith("manifest")]
    hurt = run.rng.sample(data, min(3, len(data)))
    for p in hurt:
        if run.rng.random() < 0.5:
            _flip_bytes(p, run.rng)
        else:
            with open(p, "r+b") as f:
                f.truncate(p.stat().st_size // 2)
    run.server.start()
    return {"held": True, "files_damaged": len(hurt)}


def aborted_streams(run) -> dict:
    """Streams closed after their first tokens: every request ends, its pages return."""
    before = run.server.metrics()
    for _ in range(run.args.concurrency * 2):
        body = run.turn_body(run.pick_chat(), stream=True, max_tokens=64)
        with httpx.stream("POST", run.server.base + "/v1/chat/completions", json=body,
                          timeout=120) as r:
            for n, _line in enumerate(r.iter_lines()):
                if n >= 2:
                    break
    idle = _wait_idle(run.server, 120)
    after = run.server.metrics()

    def held_pages(m: dict) -> float:
        return m.get("jkv_kv_pages_used", 0) - m.get("jkv_kv_pages_cached", 0)

    back = held_pages(after) <= held_pages(before)
    return {"held": idle and back, "idle": idle, "pages_held_before": held_pages(before),
            "pages_held_after": held_pages(after)}


def _wait_idle(server, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        m = server.metrics()
        if m.get("jkv_num_requests_running", 0) == 0 and m.get(
                "jkv_num_requests_waiting", 0) == 0:
            return True
        time.sleep(0.5)
    return False


HOSTILE_BODIES = (
    b"{", b"[]", b"null", b'{"messages": "hi"}', b'{"messages": [{"role": "x"}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e308}',
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}',
    b'{"messages": [{"role": "user", "content": "hi"}], "n": 1000000}',
    b'{"messages": [{"role": "user", "content": "hi"}], "model": "nope"}',
    b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json"}}',
    b'{"messages": [{"role": "user", "content": "hi"}], "session_id": "' + b"s" * 5000 + b'"}',
    b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"prompt": [[1, 2], [3, -4]]}', b'{"prompt": [99999999999]}',
)


def hostile_bodies(run) -> dict:
    """Each body gets a 4xx JSON error body; the server still answers afterwards."""
    bad = []
    for body in HOSTILE_BODIES:
        path = "/v1/completions" if body.startswith(b'{"prompt"') else "/v1/chat/completions"
        r = httpx.post(run.server.base + path, content=body, timeout=60,
                       headers={"content-type": "application/json"})
        try:
            ok = 400 <= r.status_code < 500 and "message" in r.json()["error"]
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            bad.append({"body": body[:80].decode(errors="replace"), "status": r.status_code})
    healthy = httpx.get(run.server.base + "/health", timeout=10).status_code == 200
    return {"held": not bad and healthy, "bodies": len(HOSTILE_BODIES), "not_4xx_json": bad}


def huge_sessions(run) -> dict:
    """Two 10,000-message session chats in flight; a plain request must not wait on them."""
    plain = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
             "temperature": 0}
    t0 = time.monotonic()
    httpx.post(run.server.base + "/v1/chat/completions", json=plain, timeout=300)
    alone = time.monotonic() - t0
    huge = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"}
            for i in range(10_000)] + [{"role": "user", "content": "hi"}]
    statuses: list[int] = []

    def send(i: int) -> None:
        body = {"messages": huge, "session_id": f"huge-{run.rng.random()}-{i}",
                "max_tokens": 4}
        try:
            statuses.append(httpx.post(run.server.base + "/v1/chat/completions", json=body,
                                       timeout=600).status_code)
        except httpx.HTTPError as e:
            statuses.append(type(e).__name__)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    r = httpx.post(run.server.base + "/v1/chat/completions", json=plain, timeout=600)
    waited = time.monotonic() - t0
    for t in threads:
        t.join(600)
    held = r.status_code == 200 and waited <= alone + PLAIN_REQUEST_SECONDS
    return {"held": held, "plain_alone_s": round(alone, 2), "plain_beside_huge_s":
            round(waited, 2), "huge_statuses": statuses}


FAULTS = {f.__name__: f for f in (kill_mid_stream, kill_after_reply, kill_idle, disk_fills,
                                   manifest_damage, data_damage, aborted_streams,
                                   hostile_bodies, huge_sessions)}
