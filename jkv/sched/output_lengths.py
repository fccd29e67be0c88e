"""How long a reply will be: what LayerKV's TPOT slack (eq. 1) needs of a decoding request's
future, and what the layer-offload checks weigh a request's steps over."""

from __future__ import annotations

import collections

import numpy as np


class OutputLengths:
    """How long a reply will be, for TPOT slack (LayerKV 3.1): the lengths of finished
    replies, per session and of the last `window` overall. An estimate is conservative (a
    low quantile: a short future leaves less slack), never above the request's max_tokens."""

    def __init__(self, quantile: float = 0.25, window: int = 256) -> None:
        self.quantile = quantile
        self.recent: collections.deque[int] = collections.deque(maxlen=window)
        self.sessions: dict[str, collections.deque[int]] = {}
        # each source's quantile until its next reply: every request asks every step
        self._totals: dict[str | None, int] = {}

    def add(self, session: str | None, length: int) -> None:
        self.recent.append(length)
        self._totals.pop(None, None)
        if session is not None:
            self.sessions.setdefault(session, collections.deque(maxlen=16)).append(length)
            self._totals.pop(session, None)

    def remaining(self, session: str | None, max_tokens: int, generated: int) -> int:
        """Tokens a request that has generated `generated` is expected to generate still
        (at least 1): from its session's replies, else recent ones, else just the next."""
        source = session if session is not None and self.sessions.get(session) else None
        total = self._totals.get(source)
        if total is None:
            seen = self.recent if source is None else self.sessions[source]
            total = self._totals[source] = (int(np.quantile(list(seen), self.quantile))
                                            if seen else 0)
        return max(1, min(total, max_tokens) - generated)


__all__ = ["OutputLengths"]
