"""An operator's trial of a jkv server with a KV store, as a repeatable script: multi-turn
chats whose every greedy reply is compared with a server that has no store, while faults are
injected between rounds (`chaos_faults.py`: kill -9 at three moments, a filesystem that
fills, a damaged manifest, damaged data files, aborted streams, hostile bodies, 10,000-message
session chats) and the server's RSS, open descriptors and pages are sampled.

    python benchmarks/chaos.py --minutes 30            # the acceptance run
    python benchmarks/chaos.py --minutes 3 --soak-minutes 1 --faults kill_idle,hostile_bodies

Run as root it puts the store on its own tmpfs (`--tmpfs-mib`) so the disk really fills;
otherwise the full-disk fault is skipped. A reply is wrong when its text differs from the
reference server's for the same body. The last `--soak-minutes` inject no kills, so one
server lifetime is long; RSS is bounded when, in every lifetime of at least 10 samples, the
largest RSS of its second half is at most `RSS_GROWTH` times the largest of its first half.
Prints a table and writes benchmarks/results/chaos/chaos-<date>.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from chaos_faults import FAULTS
from chaos_server import ServerProcess
from harness import add_out_argument, write_results

RSS_GROWTH = 1.25
_WORDS = ("time way year work day part life case point group number world house area "
          "company problem service place hand party school country system program question "
          "night story family fact money member water month book word business issue side "
          "kind head eye job game line end city office").split()


class Chaos:
    """The run: the server under trial, the reference, the chats and the tallies."""

    def __init__(self, args: argparse.Namespace, work: Path, tmpfs: Path | None) -> None:
        self.args, self.tmpfs, self.rng = args, tmpfs, random.Random(args.seed)
        self.store_dir = (tmpfs or work) / "store"
        common = ["--max-model-len", str(args.max_model_len), "--max-num-seqs",
                  str(args.concurrency), *shlex.split(args.server_args)]
        self.server = ServerProcess("store", [*common, "--store-dir", str(self.store_dir),
                                              "--host-cache-bytes", args.host_cache], work)
        self.reference = ServerProcess("reference", common, work)
        self.chats: list[dict] = [self._new_chat(i) for i in range(args.chats)]
        self.compared = self.wrong = self.errors = 0
        self.mismatches: list[dict] = []
        self.samples: list[dict] = []
        self._replies: dict[str, str] = {}

    def _new_chat(self, i: int) -> dict:
        return {"id": f"chat-{i}-{self.rng.random():.6f}", "messages": [self._user()]}

    def _user(self) -> dict:
        words = " ".join(self.rng.choice(_WORDS) for _ in range(self.rng.randint(5, 40)))
        return {"role": "user", "content": f"{words}. What do you make of that?"}

    def pick_chat(self) -> dict:
        return self.rng.choice(self.chats)

    def turn_body(self, chat: dict, stream: bool = False, max_tokens: int | None = None
                  ) -> dict:
        return {"messages": chat["messages"], "session_id": chat["id"], "temperature": 0,
                "max_tokens": max_tokens or self.args.max_tokens, "stream": stream}

    def _reference_reply(self, body: dict) -> str:
        key = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        if key not in self._replies:
            r = httpx.post(self.reference.base + "/v1/chat/completions", json=body,
                           timeout=600)
            r.raise_for_status()
            self._replies[key] = r.json()["choices"][0]["message"]["content"]
        return self._replies[key]

    def one_turn(self, chat: dict) -> None:
        """Ask the server under trial, compare with the reference, and continue the chat
        with the reference's reply (so every chat's history is the same whatever failed)."""
        body = self.turn_body(chat)
        expected = self._reference_reply(body)
        try:
            r = httpx.post(self.server.base + "/v1/chat/completions", json=body, timeout=600)
            got = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError):
            got = None
        if got is None:
            self.errors += 1
        else:
            self.compared += 1
            if got != expected:
                self.wrong += 1
                if len(self.mismatches) < 5:
                    self.mismatches.append({"chat": chat["id"], "turn": len(chat["messages"]),
                                            "got": got, "expected": expected})
        chat["messages"] = [*chat["messages"], {"role": "assistant", "content": expected},
                            self._user()]
        if sum(len(m["content"]) for m in chat["messages"]) > self.args.max_model_len * 2:
            self.chats[self.chats.index(chat)] = self._new_chat(self.rng.randrange(10**6))

    def round(self) -> None:
        """One turn of `concurrency` chats at once; a dead server is a crash, restarted."""
        if not self.server.alive():
            self.server.start()
        chats = self.rng.sample(self.chats, min(self.args.concurrency, len(self.chats)))
        with ThreadPoolExecutor(len(chats)) as pool:
            list(pool.map(self.one_turn, chats))
        self.samples.append({"start": self.server.starts, **self.server.sample()})


def rss_bounded(samples: list[dict]) -> tuple[bool, list]:
    """Per server lifetime with >= 10 samples: (max RSS of its first half, of its second)."""
    lives: dict[int, list[float]] = {}
    for s in samples:
        lives.setdefault(s["start"], []).append(s["rss_mib"])
    halves = [(max(v[:len(v) // 2]), max(v[len(v) // 2:])) for v in lives.values()
              if len(v) >= 10]
    return all(b <= RSS_GROWTH * a for a, b in halves), halves


def mount_tmpfs(work: Path, mib: int) -> Path | None:
    if os.geteuid() != 0 or mib <= 0:
        return None
    path = work / "fs"
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)],
                          capture_output=True)
    return path if done.returncode == 0 else None


def trial(run: Chaos, faults: list[str], minutes: float) -> dict:
    """Rounds of chats with a fault between every two, until the time is up."""
    observed: dict[str, list] = {name: [] for name in faults}
    deadline = time.monotonic() + minutes * 60
    while time.monotonic() < deadline:
        for name in run.rng.sample(faults, len(faults)):
            if time.monotonic() >= deadline:
                break
            run.round()
            t0 = time.monotonic()
            record = FAULTS[name](run)
            observed[name].append({**record, "seconds": round(time.monotonic() - t0, 1)})
            print(f"[{time.strftime('%H:%M:%S')}] {name}: {record}", flush=True)
            run.round()
    return observed


_SOAK_FAULTS = ("aborted_streams", "hostile_bodies")


def soak(run: Chaos, minutes: float) -> None:
    """Rounds with no kill (one lifetime, so RSS growth shows), streams aborted and hostile
    bodies sent every fifth round."""
    deadline, n = time.monotonic() + minutes * 60, 0
    while time.monotonic() < deadline:
        run.round()
        n += 1
        if n % 5 == 0:
            FAULTS[_SOAK_FAULTS[(n // 5) % 2]](run)


def summarize(run: Chaos, observed: dict, minutes: float) -> dict:
    bounded, halves = rss_bounded(run.samples)
    faults = {name: {"runs": len(recs), "held": sum(bool(r.get("held")) for r in recs),
                     "skipped": sum("skipped" in r for r in recs), "records": recs}
              for name, recs in observed.items()}
    last = run.samples[-1] if run.samples else {}
    return {"minutes": minutes, "replies_compared": run.compared, "wrong_replies": run.wrong,
            "failed_requests": run.errors, "crashes": run.server.crashes,
            "kills": run.server.kills, "rss_bounded": bounded, "rss_halves_mib": halves,
            "faults": faults, "mismatches": run.mismatches,
            "store_counters": {k: v for k, v in last.items() if k.startswith("jkv_store")},
            "samples": run.samples}


def print_table(result: dict) -> None:
    print(f"\n{'fault':<18} {'runs':>5} {'held':>5} {'skipped':>8}")
    for name, f in result["faults"].items():
        print(f"{name:<18} {f['runs']:>5} {f['held']:>5} {f['skipped']:>8}")
    print(f"\nreplies compared {result['replies_compared']}, wrong {result['wrong_replies']},"
          f" failed requests {result['failed_requests']}, crashes {result['crashes']},"
          f" kills {result['kills']}, RSS bounded {result['rss_bounded']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30, help="how long to inject faults")
    p.add_argument("--soak-minutes", type=float, default=10,
                   help="of those, the last minutes: no kills, RSS and pages watched")
    p.add_argument("--faults", default=",".join(FAULTS),
                   help=f"comma-separated, from: {', '.join(FAULTS)}")
    p.add_argument("--chats", type=int, default=8, help="conversations kept going")
    p.add_argument("--concurrency", type=int, default=4, help="turns sent at once")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per reply")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--host-cache", default="4MiB",
                   help="the store server's host tier (small, so entries reach the disk)")
    p.add_argument("--tmpfs-mib", type=int, default=64,
                   help="size of the tmpfs holding the store when run as root (0: none)")
    p.add_argument("--server-args", default="", help="more flags for both servers")
    p.add_argument("--seed", type=int, default=0)
    add_out_argument(p, "chaos")
    args = p.parse_args(argv)
    if not 0 <= args.soak_minutes <= args.minutes:
        p.error("--soak-minutes must be between 0 and --minutes")
    unknown = set(args.faults.split(",")) - set(FAULTS)
    if unknown:
        p.error(f"--faults: unknown {sorted(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="jkv-chaos-") as tmp:
        work = Path(tmp)
        tmpfs = mount_tmpfs(work, args.tmpfs_mib)
        run = Chaos(args, work, tmpfs)
        try:
            run.reference.start()
            run.server.start()
            observed = trial(run, args.faults.split(","), args.minutes - args.soak_minutes)
            soak(run, args.soak_minutes)
            result = summarize(run, observed, args.minutes)
        finally:
            run.server.stop()
            run.reference.stop()
            if tmpfs is not None:
                subprocess.run(["umount", str(tmpfs)], check=False)
        print_table(result)
        write_results(args.out, "chaos", result, args)
    held = result["wrong_replies"] == 0 and result["crashes"] == 0 and result["rss_bounded"]
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
