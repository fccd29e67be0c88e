"""Admission before any expensive work (`Admission`). A body's messages and characters are
counted on the event loop, against `Limits`; the prompt is then made (chat template,
tokenization, a session's truncation) on a small thread pool, by jobs that count against the
queue limit beside the scheduler's waiting requests, show in /metrics
(`jkv_num_requests_tokenizing`), end at the request's deadline, and stop when their client
goes away: a job not begun is skipped, a running one stops at its next check between
renders. `readiness` says whether the server takes new work (GET /ready)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request

from jkv.api import LLM
from jkv.prompts import Cancelled
from jkv.server.protocol import APIError

MAX_MESSAGES = 2048  # a chat's messages at most, by default (OpenAI's limit too)
MAX_PROMPT_CHARS = 1 << 20  # a prompt's characters at most, by default (the body limit's)
POLL_S = 0.5  # how often a request waiting on its prompt looks for its client
TOKENIZER_THREADS = 2

T = TypeVar("T")


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the tokenizer; None: no limit."""

    max_messages: int | None = MAX_MESSAGES
    max_prompt_chars: int | None = MAX_PROMPT_CHARS  # the chat template's text, or a prompt


class ClientGone(Exception):
    """The client went away while its prompt was being made (the work was cancelled)."""


def deadline_error(timeout: float | None) -> APIError:
    """The 503 of a request that ran past `--request-timeout`."""
    return APIError(503, f"the request ran past its deadline of {timeout} s",
                    type="server_error", code="deadline_exceeded", headers={"Retry-After": "1"})


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", type="server_error")


class Admission:
    """The server's gate: body limits, the queue limit, and the tokenizer pool's jobs."""

    def __init__(self, llm: LLM, max_queue: int | None, limits: Limits,
                 threads: int = TOKENIZER_THREADS) -> None:
        self.llm, self.max_queue, self.limits = llm, max_queue, limits
        self.executor = ThreadPoolExecutor(max_workers=threads,
                                           thread_name_prefix="jkv-tokenize")
        self.closing = threading.Event()
        self._lock = threading.Lock()
        self._jobs: set[threading.Event] = set()  # each job's cancel flag, until it ends

    @property
    def tokenizing(self) -> int:
        """Requests waiting for or under tokenization (a cancelled job counts until it
        stops)."""
        with self._lock:
            return len(self._jobs)

    def close(self) -> None:
        self.closing.set()
        self.cancel_all()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def cancel_all(self) -> None:
        with self._lock:
            for flag in self._jobs:
                flag.set()

    # ------------------------------------------------------------ checks on the event loop

    def check_chat(self, messages: list[dict]) -> None:
        """A 400 naming `messages` for more of them, or of their characters, than allowed
        (the template's own text is counted once rendered: `max_chars`)."""
        lim = self.limits
        if lim.max_messages is not None and len(messages) > lim.max_messages:
            raise APIError(400, f"messages has {len(messages)} items; this server takes at "
                                f"most {lim.max_messages} (--max-messages)", param="messages")
        chars = sum(len(m["content"]) for m in messages)
        if lim.max_prompt_chars is not None and chars > lim.max_prompt_chars:
            raise APIError(400, f"messages hold {chars} characters; this server takes at "
                                f"most {lim.max_prompt_chars} (--max-prompt-chars)",
                           param="messages")

    def check_prompt(self, prompt: str | list) -> None:
        """A 400 naming `prompt` for a text prompt longer than allowed."""
        limit = self.limits.max_prompt_chars
        if isinstance(prompt, str) and limit is not None and len(prompt) > limit:
            raise APIError(400, f"prompt has {len(prompt)} characters; this server takes at "
                                f"most {limit} (--max-prompt-chars)", param="prompt")

    def _waiting(self) -> int:
        return self.llm.scheduler.num_waiting + self.tokenizing

    def readiness(self) -> tuple[str, str | None]:
        """("ready", None), or why new work would be refused now: ("draining" | "starting" |
        "queue_full", reason)."""
        if self.closing.is_set():
            return "draining", "the server is shutting down"
        if not self.llm.serving:
            return "starting", "the scheduler loop is not running"
        if self.max_queue is not None and (n := self._waiting()) >= self.max_queue:
            return "queue_full", (f"{n} requests wait (tokenizing or queued); the limit is "
                                  f"{self.max_queue}")
        return "ready", None

    def refuse_if_busy(self) -> None:
        """A 503 while draining or while `max_queue` requests wait (tokenizing or queued)."""
        if self.closing.is_set():
            raise _shutting_down()
        if self.max_queue is not None and self._waiting() >= self.max_queue:
            raise APIError(503, f"the queue is full ({self.max_queue} requests waiting); "
                                f"retry later", type="server_error", code="queue_full",
                           headers={"Retry-After": "1"})

    # ------------------------------------------------------------ the tokenizer pool

    async def prepare(self, request: Request, work: Callable[[Callable[[], bool]], T],
                      deadline: float | None, timeout: float | None = None) -> T:
        """`work(cancelled)` on the pool, awaited. ClientGone when the client leaves first,
        the deadline's 503 when it passes first; either sets the job's cancel flag, which
        `work` polls between its steps (a job not begun is skipped)."""
        flag = threading.Event()
        with self._lock:
            self._jobs.add(flag)
        future = asyncio.get_running_loop().run_in_executor(self.executor, self._run, flag,
                                                            work)
        future.add_done_callback(_consume)
        try:
            while not future.done():
                wait = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
                if wait > 0:
                    await asyncio.wait({future}, timeout=wait)
                if future.done():
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    raise deadline_error(timeout)
                if await request.is_disconnected():
                    raise ClientGone
        except BaseException:
            flag.set()
            raise
        if future.cancelled():  # the pool shut down before the job began
            self._end(flag)
            raise _shutting_down()
        if isinstance(future.exception(), Cancelled):  # cancel_all (a drain ran out)
            raise _shutting_down()
        return future.result()

    def _run(self, flag: threading.Event, work: Callable[[Callable[[], bool]], T]) -> T:
        try:
            if flag.is_set():
                raise Cancelled("cancelled before it began")
            return work(flag.is_set)
        finally:
            self._end(flag)

    def _end(self, flag: threading.Event) -> None:
        with self._lock:
            self._jobs.discard(flag)


def _consume(future: asyncio.Future) -> None:
    """Retrieve a job's outcome, so a job whose request left is not logged as an error."""
    if not future.cancelled():
        future.exception()
