"""What an engine step takes and gives back: the sizes its rows may have, each row's
`Sampled` token (with its log-probability, the most likely alternatives and, asked for, every
fed position's), and the engine's running `EngineStats`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from jkv.engine.runner import Row


class Sampled(NamedTuple):
    """A row's new token, its log-probability and the most likely alternatives."""

    token: int
    logprob: float
    top_ids: np.ndarray  # int32 [MAX_LOGPROBS], most likely first
    top_logprobs: np.ndarray  # float32 [MAX_LOGPROBS]
    # with Row.targets: per fed token (target logprob, top ids, top logprobs) [m], [m, K]
    positions: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    # the row's block starts' fingerprints: (positions [2], -1 none; [2, SKETCH_DIMS])
    marks: tuple[np.ndarray, np.ndarray] | None = None


@dataclass
class EngineStats:
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0  # steps with prefill rows
    decode_tokens: int = 0
    decode_seconds: float = 0.0  # steps with decode rows only
    steps: int = 0
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of which found on the device
    restored_tokens: int = 0  # prompt tokens whose KV came from saved pages (`open(restore=)`)
    # of which recomputed instead by split restores, per layer (half the layers: 0.5 each)
    recomputed_tokens: float = 0.0
    step_shapes: set = field(default_factory=set)  # (rows, tokens) buckets run

    @property
    def prefill_token_seconds(self) -> float:
        """Measured seconds per prompt token (0.0 before any prefill)."""
        return self.prefill_seconds / max(self.prefill_tokens, 1)


def sampled_rows(groups: Sequence[Sequence[Row]], outs: Sequence[tuple],
                 layered: Sequence[Row], outs_layered: Sequence[tuple | None]
                 ) -> dict[int, Sampled | None]:
    """Each row's `Sampled`, by `id(row)`, from a step's host outputs: each call's (tokens,
    logprobs, top ids, top logprobs, fingerprints' positions and fingerprints, and per
    position with targets), and each layer-major row's (None before its last layer; its
    fingerprints: its last call's)."""
    sampled: dict[int, Sampled | None] = {}
    for r, out in zip(layered, outs_layered, strict=True):
        sampled[id(r)] = None if out is None else Sampled(
            int(out[0][0]), float(out[1][0]), out[2][0], out[3][0], marks=(out[4][0], out[5][0]))
    for group, (tokens, logprob, top_ids, top_lp, mark_at, mark, *at) in zip(groups, outs,
                                                                           strict=True):
        for i, r in enumerate(group):
            m = len(r.tokens)
            positions = (tuple(x[i, :m] for x in at)
                         if at and r.targets is not None else None)
            sampled[id(r)] = Sampled(int(tokens[i]), float(logprob[i]), top_ids[i],
                                     top_lp[i], positions, (mark_at[i], mark[i]))
    return sampled


def check_row_sizes(prefill: Sequence[Row], decode: Sequence[Row], chunk: int) -> None:
    """ValueError unless each prefill row (not fed layer-major) feeds 1..`chunk` tokens and
    each decode row one."""
    for r in prefill:
        if r.layer_span is None and not 1 <= len(r.tokens) <= chunk:
            raise ValueError(f"a prefill row feeds 1..{chunk} tokens, got {len(r.tokens)}")
    if any(len(r.tokens) != 1 for r in decode):
        raise ValueError("a decode row feeds exactly one token")
