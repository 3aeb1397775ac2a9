"""DeepSpeed's fast mode over ZeRO stage and micro-batch size, as pure logic: which
experiment comes next from the results so far."""

from __future__ import annotations

import pytest

from raytrain_x.common.errors import ConfigError
from raytrain_x.tune_integration.zero_search import FastMode


def _search(plan: FastMode, measure) -> list[tuple[int, int]]:
    """Runs the plan against `measure(stage, mbs) -> (score or None, peak MB)`."""
    tried = []
    while (config := plan.next()) is not None:
        tried.append((config["zero_stage"], config["micro_batch_size"]))
        plan.record(config, *measure(config["zero_stage"], config["micro_batch_size"]))
        assert len(tried) < 50
    return tried


def _throughput_until(best_mbs: dict[int, int], memory_per_sample: dict[int, float]):
    """Throughput rises with the micro-batch up to best_mbs[stage], then falls."""
    def measure(stage, mbs):
        score = 100 * min(mbs, best_mbs[stage]) - (mbs > best_mbs[stage]) * 10 - stage
        return score, mbs * memory_per_sample[stage]
    return measure


def test_each_stage_climbs_until_the_memory_cap_and_a_better_stage_goes_on():
    plan = FastMode([0, 1, 2], [1, 2, 4, 8, 16], max_memory_mb=70)
    measure = _throughput_until({0: 16, 1: 16, 2: 16}, {0: 8.0, 1: 4.0, 2: 3.0})
    # stage 0: 1, 2, 4, 8 (8 x 8 = 64 MB), 16 over the cap; stage 1 from 8: 8, 16 (64 MB);
    # stage 2 from 16: 16 (48 MB) no faster than stage 1's (100 x 16 - 2 < - 1): the end
    assert _search(plan, measure) == [(0, 1), (0, 2), (0, 4), (0, 8), (0, 16),
                                      (1, 8), (1, 16), (2, 16)]
    best = max((t for t in plan.trials if t.score is not None), key=lambda t: t.score)
    assert best.config == {"zero_stage": 1, "micro_batch_size": 16}
    over = plan.trials[4]
    assert over.score is None and "over max_memory_per_worker 70 MB" in over.verdict


def test_a_stage_ends_when_the_metric_stops_rising():
    plan = FastMode([0, 1], [1, 2, 4, 8])
    measure = _throughput_until({0: 2, 1: 2}, {0: 1.0, 1: 1.0})
    # stage 0: 1, 2, 4 (falls: ends); stage 1 from 2: 2, 4 (falls); not better: the end
    assert _search(plan, measure) == [(0, 1), (0, 2), (0, 4), (1, 2), (1, 4)]


def test_a_stage_that_fails_at_its_smallest_micro_batch_hands_over_to_the_next():
    plan = FastMode([0, 1], [4, 8])
    tried = _search(plan, lambda stage, mbs: (None, 0) if stage == 0 else (mbs * 1.0, 0))
    assert tried == [(0, 4), (1, 4), (1, 8)]


def test_a_time_is_minimised():
    plan = FastMode([0], [1, 2, 4], mode="min")
    assert _search(plan, lambda stage, mbs: (10.0 / mbs, 0)) == [(0, 1), (0, 2), (0, 4)]


def test_empty_lists_are_a_config_error():
    with pytest.raises(ConfigError, match="zero_stage and micro_batch_size"):
        FastMode([], [1])


def test_a_stage_whose_starting_size_does_not_fit_steps_down():
    """Stage 1 starts at stage 0's best (16), which goes over the cap here (the sharded
    state's savings are less than the measured noise): it tries 8, which fits, and does not
    go back up to 16."""
    peaks = {(0, 4): 50, (0, 8): 60, (0, 16): 70, (0, 32): 99, (1, 16): 81, (1, 8): 55}
    plan = FastMode([0, 1], [4, 8, 16, 32], max_memory_mb=80)
    tried = _search(plan, lambda stage, mbs: (mbs * 10.0 + stage, peaks[(stage, mbs)]))
    assert tried == [(0, 4), (0, 8), (0, 16), (0, 32), (1, 16), (1, 8)]
    assert plan.trials[-1].verdict == "best of its stage so far"
