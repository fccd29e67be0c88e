"""How long a reply will be: what LayerKV's TPOT slack (eq. 1) needs of a decoding request's
future, and what the layer-offload checks weigh a request's steps over."""

from __future__ import annotations

import collections

import numpy as np


class OutputLengths:
    """How long a reply will be, for TPOT slack (LayerKV 3.1): the lengths of finished
    replies, per session and of the last `window` overall. An estimate is conservative (a
    low quantile: a short future leaves less slack), never above the request's max_tokens.
    At most `max_sessions` sessions are remembered, those with the latest replies: a client
    cycling through session ids cannot grow the server's memory."""

    def __init__(self, quantile: float = 0.25, window: int = 256,
                 max_sessions: int = 10_000) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.quantile, self.max_sessions = quantile, max_sessions
        self.recent: collections.deque[int] = collections.deque(maxlen=window)
        # session -> its last replies' lengths, the least recently answered first
        self.sessions: collections.OrderedDict[str, collections.deque[int]] = (
            collections.OrderedDict())
        # each source's quantile until its next reply: every request asks every step
        self._totals: dict[str | None, int] = {}

    def add(self, session: str | None, length: int) -> None:
        self.recent.append(length)
        self._totals.pop(None, None)
        if session is not None:
            self.sessions.setdefault(session, collections.deque(maxlen=16)).append(length)
            self.sessions.move_to_end(session)
            self._totals.pop(session, None)
            while len(self.sessions) > self.max_sessions:
                self._totals.pop(self.sessions.popitem(last=False)[0], None)

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
