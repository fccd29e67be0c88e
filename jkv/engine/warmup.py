"""Compiling step shapes before the requests that take them.

`Engine.warmup` compiles every shape at once (the server's --precompile). `Warmup` compiles
the shapes a lone request takes (`single_shapes`: a fraction of them, cheap enough on a
CPU) one per call, then what opens, grows, ends and saves a sequence, as the serving loop's
idle hook (`Scheduler.serve(idle=)`): the loop's own thread compiles between steps, so the
engine never runs two calls at once, and a request arriving meanwhile waits for one
shape's compilation at most.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

from jkv.engine.engine import Engine

log = logging.getLogger(__name__)


def single_shapes(engine: Engine) -> list[tuple[int, int]]:
    """The shapes a lone request's calls take: one row, decoding or prefilling a chunk of
    any token bucket (what a server's first request needs)."""
    return [(rows, tokens) for rows, tokens in engine.shapes() if rows == 1]


class Warmup:
    """An engine's `single_shapes` compiled one per call, each logged ('warming step shapes
    k/n'), then the rest; a call returns True while some are left. `done` is set once all
    are compiled, or when one fails (logged: the rest compile when first taken)."""

    def __init__(self, engine: Engine) -> None:
        self.shapes = single_shapes(engine)
        self.done = threading.Event()
        self._steps = self._compile(engine)
        self._count, self._seconds = 0, 0.0

    def _compile(self, engine: Engine) -> Iterator[None]:
        """Each shape (`Engine.warm_call`), then the rest (`Engine.warm_own`)."""
        for rows, tokens in self.shapes:
            engine.warm_call(rows, tokens)
            yield
        engine.warm_own()

    def __call__(self) -> bool:
        if self.done.is_set():
            return False
        t0 = time.perf_counter()
        try:
            next(self._steps)
        except StopIteration:
            self._seconds += time.perf_counter() - t0
            log.info("warmed %d step shapes in %.1f s", len(self.shapes), self._seconds)
            self.done.set()
            return False
        except Exception:
            log.exception("warming step shapes failed; the others compile when first taken")
            self.done.set()
            return False
        self._seconds += time.perf_counter() - t0
        self._count += 1
        rows, tokens = self.shapes[self._count - 1]
        log.info("warming step shapes %d/%d (rows x tokens: %d x %d)", self._count,
                 len(self.shapes), rows, tokens)
        return True
