"""What a step costs the serving loop, learned from the steps it ran: the numbers the SLO
checks (TPOT slack, LayerKV eq. 1-3) and the restore planner weigh."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from jkv.averages import moving_average

FORGET = 0.995  # of the fit's older steps, each step: about the last 200 steps count
MIN_BROUGHT = 8  # steps with layers brought in before their cost is taken as known
MIN_FITTED = 32  # steps of decodes before the fit estimates a row bucket not measured
RIDGE = 1e-4  # what holds a part no recent step varied at 0 (against a singular solve)


_compiles = 0  # JAX traces, compilations and persistent-cache loads, in this process


def _count(event: str, *args, **kwargs) -> None:
    global _compiles
    if event.startswith(("/jax/core/compile/", "/jax/compilation_cache/cache_retrieval")):
        _compiles += 1


jax.monitoring.register_event_duration_secs_listener(_count)


def compilations() -> int:
    """How many times JAX has traced, compiled or loaded a compiled function in this process
    so far: a step during which this moved took a compilation's time too, and is no sample
    of what a step costs (learned, the seconds of a compile made the steps after it look
    several times dearer than they were, until the average forgot it)."""
    return _compiles


class StepCosts:
    """Running averages of measured step times, split into parts: a step of decodes by its
    row bucket (on a CPU each row costs its share of the compute, so a step of several
    decodes costs a multiple of a step of one; on a GPU rows come nearly free), a prefill
    row and a prefill token on top of a step's decodes, and each offloaded layer a step
    brings in on top of them (from a least-squares fit of the decode steps)."""

    def __init__(self, rows_bucket: Callable[[int], int]) -> None:
        self.rows_bucket = rows_bucket
        self.by_rows: dict[int, float] = {}  # row bucket -> seconds of a step of decodes
        # a prefill's seconds on top of the decodes ~ e x prefill rows + f x tokens (fitted
        # like the decodes, each part >= 0): a row is a call with its own dispatches and
        # padding (on a CPU a call costs as much as many tokens), so a chunk's short tail
        # is no sample of what a token costs. Averaged per step instead, those tails
        # read as many times a token's true cost, and the SLO check (eq. 2) cut chunks to
        # a few tokens, each a call: dearer per token still
        self.prefill_row_s = 0.0
        self.prefill_token_s = 0.0
        self._prefill_fit = np.zeros(2)
        self._prefill_gram = np.zeros((2, 2))
        self._prefill_moment = np.zeros(2)
        self.offload_layer_s = 0.0
        # steps of decodes, with and without layers brought in, fitted together (least
        # squares, older steps fading): seconds ~ a + b x padded rows + c x thousands of
        # tokens of context + d x layers brought. d is the layers' cost: steps that bring
        # layers in rarely share their row bucket and context with a step that did not (on a
        # CPU more context or more rows cost far more than a layer brought in: put on the
        # layers, that would read as layers many times dearer than they are); a row bucket
        # never seen without layers brought in is the fit's too. The fit is solved afresh
        # from its faded sums each step, every part at least 0: updated recursively, its
        # uncertainty matrix stopped being positive definite over long replays and the fit
        # diverged (costs read orders of magnitude above the true ones)
        self._fit = np.zeros(4)
        self._gram = np.zeros((4, 4))  # faded sums of x x' and of seconds x
        self._moment = np.zeros(4)
        self._fitted = self._brought = 0  # steps fitted; those that brought layers in
        self._row_context = 0.0  # tokens of context a decoding row has, on average

    def decode(self, rows: int) -> float:
        """Seconds of a step of `rows` decodes with every layer in the pool: as measured at
        their bucket; else, once the fit has seen `MIN_FITTED` steps, its estimate at the
        recent context a row (no less than a smaller bucket's measure); else as at the
        bucket measured nearest by
        ratio (the larger of two as near); 0 before any."""
        if rows <= 0 or not self.by_rows:
            return 0.0
        b = self.rows_bucket(rows)
        if b in self.by_rows:
            return self.by_rows[b]
        if self._fitted >= MIN_FITTED:
            x = np.array([1.0, b, rows * self._row_context / 1000, 0.0])
            below = [v for k, v in self.by_rows.items() if k < b]
            return max(float(x @ self._fit), *below, 0.0)
        near = min(self.by_rows, key=lambda k: (max(k, b) / min(k, b), -k))
        return self.by_rows[near]

    def step(self, rows: int, brings: int) -> float:
        """Seconds of a step of `rows` decodes that brings `brings` offloaded layers in."""
        return self.decode(rows) + brings * self.offload_layer_s

    def chunked_token_s(self, chunk: int) -> float:
        """Seconds a prompt token costs fed in full chunks of `chunk` tokens, its share of
        a row's cost included: what recomputing a long prefix costs a token (with a tiny
        model the row is nearly all of it)."""
        return self.prefill_token_s + self.prefill_row_s / chunk

    def learn(self, seconds: float, prefill_tokens: int, rows: int, brings: int = 0,
              context: int = 0, prefill_rows: int = 1) -> None:
        """A step that took `seconds` for `prefill_tokens` prefill tokens in `prefill_rows`
        rows, `rows` decodes over `context` tokens of context and `brings` offloaded layers
        brought in: every step of decodes alone is the fit's sample, one with no layers
        brought in its bucket's too; with prefill tokens, what the known parts do not
        explain is the prefill fit's sample."""
        if not prefill_tokens:
            if rows:
                self._learn_fit(seconds, rows, brings, context)
            if rows and not brings:
                b = self.rows_bucket(rows)
                self.by_rows[b] = moving_average(self.by_rows.get(b, 0.0), seconds)
        else:
            base = self.decode(rows) + brings * self.offload_layer_s
            x = np.array([max(prefill_rows, 1), prefill_tokens], dtype=float)
            self._prefill_gram = FORGET * self._prefill_gram + np.outer(x, x)
            self._prefill_moment = FORGET * self._prefill_moment + max(seconds - base, 0.0) * x
            self._prefill_fit = nonnegative_least_squares(
                self._prefill_gram, self._prefill_moment, self._prefill_fit)
            self.prefill_row_s, self.prefill_token_s = map(float, self._prefill_fit)

    def _learn_fit(self, seconds: float, rows: int, brings: int, context: int) -> None:
        x = np.array([1.0, self.rows_bucket(rows), context / 1000, brings])
        self._gram = FORGET * self._gram + np.outer(x, x)
        self._moment = FORGET * self._moment + seconds * x
        self._fit = nonnegative_least_squares(self._gram, self._moment, self._fit)
        self._fitted += 1
        self._brought += brings > 0
        self._row_context = moving_average(self._row_context, context / rows)
        if self._brought >= MIN_BROUGHT:
            self.offload_layer_s = float(self._fit[3])


def nonnegative_least_squares(gram: np.ndarray, moment: np.ndarray,
                              guess: np.ndarray | None = None) -> np.ndarray:
    """The parts `p` >= 0 minimising |X p - y|^2 given X'X (`gram`) and X'y (`moment`), a
    little ridge keeping it solvable: Lawson and Hanson's active set (a step's parts are
    costs; a negative one is a fit that explains one part by taking from another, and
    extrapolates to nonsense). Tried first: every part free, then the parts free in
    `guess` (the last fit: from one step to the next they rarely change)."""
    n = len(moment)
    a = gram + RIDGE * np.eye(n)
    tol = 1e-12 * max(1.0, float(np.abs(moment).max()))
    for free in [np.ones(n, dtype=bool)] + ([guess > 0] if guess is not None else []):
        if free.any():
            p = np.zeros(n)
            p[free] = np.linalg.solve(a[np.ix_(free, free)], moment[free])
            if (p[free] > 0).all() and (moment - a @ p)[~free].max(initial=0.0) <= tol:
                return p
    p, free = np.zeros(n), np.zeros(n, dtype=bool)
    for _ in range(3 * n):
        w = moment - a @ p  # (minus) the gradient: where a part could still lower the error
        if free.all() or w[~free].max(initial=0.0) <= tol:
            break
        free[np.flatnonzero(~free)[np.argmax(w[~free])]] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.solve(a[np.ix_(free, free)], moment[free])
            if (z[free] > 0).all():
                p = z
                break
            # move toward z until a part reaches 0; that part leaves the free set
            neg = free & (z <= 0)
            t = np.min(p[neg] / (p[neg] - z[neg]))
            p = p + t * (z - p)
            free &= p > 1e-15
            p[~free] = 0.0
    return p
