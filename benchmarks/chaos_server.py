"""A `python -m jkv.server` process for `chaos.py`: start, wait until it answers, kill -9,
restart on the same store, and what an operator samples from outside (RSS, open files,
/metrics)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]  # the servers run this checkout's jkv


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """One server: its flags stay fixed over restarts, so a restart after a kill opens the
    same store. `crashes` counts exits nobody asked for."""

    def __init__(self, name: str, flags: list[str], log_dir: Path,
                 start_timeout: float = 600) -> None:
        self.name, self.flags, self.start_timeout = name, flags, start_timeout
        self.log = Path(log_dir) / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.base = ""
        self.crashes = self.kills = self.starts = 0

    def start(self) -> None:
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        with open(self.log, "a") as out:  # a pipe would fill with the log and stall the server
            out.write(f"\n==== start {time.strftime('%H:%M:%S')} ====\n")
            out.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jkv.server", "--port", str(port), *self.flags],
                stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": str(REPO)})
        self.starts += 1
        deadline = time.monotonic() + self.start_timeout
        while not self._answers():
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace").splitlines()[-25:]
                raise RuntimeError(f"{self.name} exited at start-up ({self.log}):\n"
                                   + "\n".join(tail))
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not come up in {self.start_timeout} s")
            time.sleep(0.5)

    def _answers(self) -> bool:
        try:
            return httpx.get(self.base + "/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def alive(self) -> bool:
        """False (and a crash counted) when the process ended without our signal."""
        if self.proc is not None and self.proc.poll() is not None:
            self.crashes += 1
            self.proc = None
            return False
        return self.proc is not None

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=60)
            self.kills += 1
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None

    def sample(self) -> dict:
        """RSS (MiB), open descriptors and the /metrics figures that show a leak."""
        pid = self.proc.pid
        status = Path(f"/proc/{pid}/status").read_text()
        rss_kib = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        return {"t": time.time(), "rss_mib": rss_kib / 1024, "fds": fds, **self.metrics()}

    def metrics(self) -> dict:
        """Every unlabelled series and the store's by-tier series of /metrics, by name."""
        text = httpx.get(self.base + "/metrics", timeout=30).text
        out = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, _, value = line.rpartition(" ")
            if "{" in name and 'tier="' not in name:
                continue
            try:
                out[name] = float(value)
            except ValueError:
                pass
        return out
