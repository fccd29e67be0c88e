"""The step cost model the SLO checks weigh: parts of measured step times."""

from __future__ import annotations

import pytest

from jkv.buckets import bucket
from jkv.step_costs import StepCosts


def costs() -> StepCosts:
    return StepCosts(lambda n: bucket(n, 1, 2))  # rows padded to powers of two (CPU)


def test_a_step_of_decodes_is_learned_per_row_bucket():
    c = costs()
    assert c.decode(3) == 0.0  # nothing measured
    c.learn(0.010, 0, 1)
    c.learn(0.040, 0, 3)  # bucket 4
    assert c.decode(1) == pytest.approx(0.010)
    assert c.decode(4) == pytest.approx(0.040)  # 3 and 4 share their padded shape
    assert c.decode(2) == pytest.approx(0.040)  # not measured: 1 and 4 are as near; the larger
    assert c.decode(16) == pytest.approx(0.040)  # the nearest measured
    assert c.decode(0) == 0.0
    c.learn(0.020, 0, 4)
    assert 0.020 < c.decode(4) < 0.040  # an average, each sample moving it


def test_what_a_step_of_decodes_does_not_explain_goes_to_its_unknown_part():
    c = costs()
    c.learn(0.010, 0, 2)  # two decodes alone: 10 ms
    c.learn(0.050, 0, 2, brings=4)  # then 4 offloaded layers brought in beside them
    assert c.offload_layer_s == pytest.approx(0.010)
    assert c.step(2, 3) == pytest.approx(0.040)
    c.learn(0.010 + 0.040 + 0.032, 16, 2, brings=4)  # and 16 prefill tokens on top
    assert c.prefill_token_s == pytest.approx(0.002)
    assert c.decode(2) == pytest.approx(0.010)  # steps that did more: not decode samples
    c.learn(0.032, 16, 0)  # a prefill alone
    assert c.prefill_token_s == pytest.approx(0.002)


def test_layers_are_not_learned_before_their_decodes_are():
    c = costs()
    c.learn(0.050, 0, 8, brings=4)  # what part is the decodes' is not known yet
    assert c.offload_layer_s == 0.0 and c.decode(8) == 0.0
