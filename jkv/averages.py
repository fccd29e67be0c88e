"""The one running average jkv learns rates with (restore and store read rates, step costs)."""

from __future__ import annotations

WEIGHT = 0.2  # of each new sample: a rate follows a change within about ten samples


def moving_average(old: float, new: float) -> float:
    """Exponential moving average of samples; `old` 0 (nothing seen yet) takes `new` as is."""
    return new if not old else (1 - WEIGHT) * old + WEIGHT * new
