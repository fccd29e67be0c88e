"""Conversation shapes with the ShareGPT statistics CachedAttention and Krul report: 73% of
conversations are multi-turn and they average 5.75 turns; a turn averages 630 tokens, the reply
about 6.56x the user's message (so ~84 in, ~546 out), lengths log-normal (heavy-tailed)."""

from __future__ import annotations

import math

import numpy as np

MULTI_TURN_FRACTION = 0.73
MEAN_TURNS = 5.75
MEAN_USER_TOKENS = 84
MEAN_REPLY_TOKENS = 546
MAX_TURNS = 40


def num_turns(rng: np.random.Generator) -> int:
    """1, or for a multi-turn conversation 2 + geometric: multi-turn ones average
    (5.75 - 0.27) / 0.73 = 7.5 turns."""
    if rng.random() >= MULTI_TURN_FRACTION:
        return 1
    multi_mean = (MEAN_TURNS - (1 - MULTI_TURN_FRACTION)) / MULTI_TURN_FRACTION
    return int(min(MAX_TURNS, 2 + rng.geometric(1 / (multi_mean - 1)) - 1))


def length(rng: np.random.Generator, mean: float, scale: float = 1.0) -> int:
    """A message length in tokens: log-normal with sigma 1 around `mean * scale`."""
    return max(1, int(rng.lognormal(math.log(mean * scale) - 0.5, 1.0)))
