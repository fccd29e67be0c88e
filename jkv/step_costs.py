"""What a step costs the serving loop, learned from the steps it ran: the numbers the SLO
checks (TPOT slack, LayerKV eq. 1-3) and the restore planner weigh."""

from __future__ import annotations

from collections.abc import Callable

from jkv.averages import moving_average


class StepCosts:
    """Running averages of measured step times, split into parts: a step of decodes by its
    row bucket (on a CPU each row costs its share of the compute, so a step of six decodes
    took 2.5x a step of one with SmolLM2; on a GPU rows come nearly free), a prefill token on
    top of a step's decodes, and each offloaded layer a step brings in on top of them."""

    def __init__(self, rows_bucket: Callable[[int], int]) -> None:
        self.rows_bucket = rows_bucket
        self.by_rows: dict[int, float] = {}  # row bucket -> seconds of a step of decodes
        self.prefill_token_s = 0.0
        self.offload_layer_s = 0.0

    def decode(self, rows: int) -> float:
        """Seconds of a step of `rows` decodes with every layer in the pool: as measured at
        their bucket, else at the bucket measured nearest by ratio (the larger of two as
        near); 0 before any."""
        if rows <= 0 or not self.by_rows:
            return 0.0
        b = self.rows_bucket(rows)
        near = min(self.by_rows, key=lambda k: (max(k, b) / min(k, b), -k))
        return self.by_rows[near]

    def step(self, rows: int, brings: int) -> float:
        """Seconds of a step of `rows` decodes that brings `brings` offloaded layers in."""
        return self.decode(rows) + brings * self.offload_layer_s

    def learn(self, seconds: float, prefill_tokens: int, rows: int, brings: int = 0) -> None:
        """A step that took `seconds` for `prefill_tokens` prefill tokens, `rows` decodes and
        `brings` offloaded layers brought in: a step of decodes alone is their bucket's
        sample; otherwise what the known parts do not explain is the unknown part's (the
        layers' when no prefill ran, else the prefill tokens')."""
        if not prefill_tokens and not brings:
            if rows:
                b = self.rows_bucket(rows)
                self.by_rows[b] = moving_average(self.by_rows.get(b, 0.0), seconds)
        elif not prefill_tokens:
            base = self.decode(rows)
            if base:
                self.offload_layer_s = moving_average(self.offload_layer_s,
                                                      max(seconds - base, 0.0) / brings)
        else:
            base = self.decode(rows) + brings * self.offload_layer_s
            self.prefill_token_s = moving_average(self.prefill_token_s,
                                                  max(seconds - base, 0.0) / prefill_tokens)
