"""Autotune logic: search space, controller guarantees, log schema, resume (no processes)."""

from __future__ import annotations

import csv
import json
import math

import pytest

from raytrain_x import ConfigError, Knobs
from raytrain_x.common.autotune_config import AutotuneConfig
from raytrain_x.common.autotune_log import COLUMNS, AutotuneLog, Sample, load_best_knobs
from raytrain_x.common.knobs import MB
from raytrain_x.fusion.autotune_sampler import AutotuneSampler
from raytrain_x.fusion.messages import Meta, Response
from raytrain_x.tune_integration.autotune import AutotuneController, SearchSpace


def test_space_is_joint_and_leaves_out_fixed_knobs():
    full = SearchSpace(Knobs(), frozenset()).dimensions()
    assert set(full) == set(Knobs.specs())
    space = SearchSpace(Knobs(cycle_time_ms=3.0), frozenset({"cycle_time_ms",
                                                             "hierarchical_allgather"}))
    assert set(space.dimensions()) == {"fusion_threshold_bytes", "cache_capacity",
                                       "hierarchical_allreduce"}
    knobs = space.to_knobs({"fusion_threshold_bytes": 22.0, "cache_capacity": -0.5,
                            "hierarchical_allreduce": 0.7})
    assert knobs.cycle_time_ms == 3.0  # fixed knob held constant
    assert knobs.fusion_threshold_bytes == 4 * MB
    assert knobs.cache_capacity == 0 and knobs.hierarchical_allreduce is True
    assert space.to_knobs({"fusion_threshold_bytes": 10.2}).fusion_threshold_bytes == 0


def test_point_round_trip():
    space = SearchSpace(Knobs(), frozenset())
    for knobs in (Knobs(), Knobs(fusion_threshold_bytes=0, cycle_time_ms=0.5, cache_capacity=0,
                                 hierarchical_allreduce=True)):
        assert space.to_knobs(space.to_point(knobs)) == knobs


def _score(k: Knobs) -> float:
    """A smooth synthetic landscape: best near 4 MB fusion and short cycles."""
    x = math.log2(max(k.fusion_threshold_bytes, 1024))
    return 1e9 * math.exp(-((x - 22) / 5) ** 2) / (1 + k.cycle_time_ms / 10)


def _drive(controller: AutotuneController, score=_score) -> list[Knobs]:
    measured = []
    while True:
        knobs = controller.current
        measured.append(knobs)
        if controller.report(score(knobs))["done"]:
            return measured


def test_first_sample_is_the_start_and_the_result_never_worse():
    start = Knobs(fusion_threshold_bytes=4 * MB, cycle_time_ms=0.2)  # already excellent
    controller = AutotuneController(AutotuneConfig(bayes_opt_max_samples=8), start,
                                    frozenset())
    measured = _drive(controller)
    assert measured[0] == start
    best, _ = controller.best()
    assert _score(best) >= _score(start)
    assert controller.current == best  # the knobs kept for the rest of training


def test_start_wins_ties_within_the_noise_floor():
    start = Knobs()
    controller = AutotuneController(AutotuneConfig(bayes_opt_max_samples=5,
                                                   min_improvement=0.05), start, frozenset())
    _drive(controller, score=lambda k: 100.0 if k == start else 103.0)  # +3% is noise
    assert controller.best()[0] == start


def test_search_improves_a_bad_start_and_stops_at_max_samples():
    start = Knobs(fusion_threshold_bytes=0, cycle_time_ms=40.0)
    config = AutotuneConfig(bayes_opt_max_samples=12, convergence_patience=0)
    controller = AutotuneController(config, start, frozenset({"hierarchical_allreduce",
                                                              "hierarchical_allgather"}))
    measured = _drive(controller)
    # the search stops 3 samples early (2 x confirm_top, at most a quarter of 12) ...
    assert len(set(measured[:9])) == 9  # ... and never spends a sample on a repeat
    ranked = sorted(set(measured[:9]), key=_score, reverse=True)
    assert measured[9:] == ranked[:2]  # then the top 2 are measured again: confirmed
    assert len(measured) == 11  # within bayes_opt_max_samples
    assert controller.best()[0] == ranked[0]
    assert _score(controller.best()[0]) > 3 * _score(start)


def test_a_lucky_sample_does_not_win_once_measured_again():
    start = Knobs(fusion_threshold_bytes=0, cycle_time_ms=40.0)
    order: list[Knobs] = []  # settings in the order first measured
    times: dict[Knobs, int] = {}

    def noisy(k: Knobs) -> float:
        if k not in times:
            order.append(k)
        times[k] = times.get(k, 0) + 1
        role = order.index(k)
        if role == 1:  # "lucky": 130 by chance the first time, 80 the second (really ~105)
            return 130.0 if times[k] == 1 else 80.0
        return {0: 100.0, 2: 110.0}.get(role, 50.0)  # start 100, "steady" 110, rest 50

    config = AutotuneConfig(bayes_opt_max_samples=8, convergence_patience=0)
    controller = AutotuneController(config, start, frozenset())
    _drive(controller, score=noisy)
    lucky, steady = order[1], order[2]
    assert times[lucky] == 2 and times[steady] == 2  # both candidates measured twice
    assert controller.best() == (steady, 110.0)  # by mean: 110 beats (130 + 80) / 2
    assert controller.current == steady


def test_convergence_stops_early():
    config = AutotuneConfig(bayes_opt_max_samples=50, convergence_patience=3)
    controller = AutotuneController(config, Knobs(), frozenset())
    measured = _drive(controller, score=lambda k: 1.0)  # nothing ever improves
    # the start, 3 samples without a gain, then the top 2 (tied) measured again
    assert len(measured) == 1 + 3 + 2
    assert controller.best()[0] == Knobs()


def test_nothing_to_tune_when_every_knob_is_fixed():
    controller = AutotuneController(AutotuneConfig(), Knobs(), frozenset(Knobs.specs()))
    assert controller.report(5.0)["done"]


def _response(name: str, n: int = 256) -> Response:
    return Response(name, Meta("allreduce", "float32", (n,), "average"))


def test_sampler_scores_steps_and_switches_knobs(tmp_path):
    log_path = tmp_path / "tune.csv"
    config = AutotuneConfig(log_file=str(log_path), warmup_samples=1, steps_per_sample=3,
                            sub_windows=3, bayes_opt_max_samples=2, convergence_patience=0)
    controller = AutotuneController(config, Knobs(), frozenset({"hierarchical_allreduce",
                                                                "hierarchical_allgather"}))
    requested: list[Knobs] = []
    lines: list[str] = []
    sampler = AutotuneSampler(config, controller, requested.append, lines.append)
    knobs = Knobs()
    step = 0
    while not sampler.done and step < 500:
        step += 1
        if requested and knobs != requested[-1]:
            knobs = requested[-1]  # the engine applies the request a cycle later
        sampler.on_cycle(knobs, step, [_response("a"), _response("b")])
    assert sampler.done
    rows = list(csv.DictReader(log_path.open()))
    assert list(rows[0]) == COLUMNS
    assert [r["kind"] for r in rows] == ["warmup", "sample", "sample", "best"]
    assert all(float(r["score"]) > 0 and r["unit"] == "bytes/s" for r in rows)
    assert (tmp_path / "tune.knobs.json").exists()
    assert any("warmup sample" in line for line in lines)
    assert any("sample 2/2" in line and "left" in line for line in lines)


def test_log_schema_and_resume(tmp_path):
    path = tmp_path / "log.csv"
    log = AutotuneLog(path)
    samples = [Sample(0, Knobs(), 5e8, 10, 1.0, warmup=True),
               Sample(1, Knobs(fusion_threshold_bytes=2 * MB), 6e8, 20, 2.0),
               Sample(2, Knobs(cycle_time_ms=0.25), 9e8, 30, 3.0)]
    log.append(samples[0], "warmup")
    log.append(samples[1], "sample")
    log.append(samples[2], "sample")
    with path.open() as f:
        header = f.readline().strip().split(",")
    assert header == COLUMNS and {"score", "unit", "searched", "cost"} <= set(header)
    # a log that ended before tuning did still resumes at its best scored row
    assert load_best_knobs(path) == Knobs(cycle_time_ms=0.25)
    knobs_file = log.finish(samples[1])
    rows = list(csv.DictReader(path.open()))
    assert rows[-1]["sample"] == "best" and rows[-1]["best"] == "1"
    assert rows[1]["fusion_threshold_mb"] == "2.0" and rows[1]["fusion_threshold_log2"] == "21.0"
    assert load_best_knobs(path) == Knobs(fusion_threshold_bytes=2 * MB)
    assert json.loads(knobs_file.read_text())["knobs"]["fusion_threshold_bytes"] == 2 * MB
    assert load_best_knobs(knobs_file) == Knobs(fusion_threshold_bytes=2 * MB)


def test_bad_config_and_files(tmp_path):
    with pytest.raises(ConfigError, match="steps_per_sample"):
        AutotuneConfig(steps_per_sample=0)
    with pytest.raises(ConfigError, match="does not exist"):
        AutotuneConfig(resume_from=str(tmp_path / "missing.csv"))
    bogus = tmp_path / "bogus.csv"
    bogus.write_text("a,b\n1,2\n")
    with pytest.raises(ConfigError, match="not a raytrain-x autotune log"):
        load_best_knobs(bogus)


def test_config_env_round_trip(tmp_path):
    config = AutotuneConfig(log_file=str(tmp_path / "x.csv"), steps_per_sample=7,
                            gaussian_process_noise=0.3, sampling_time_s=2.5,
                            initial_knobs=Knobs(cycle_time_ms=4.0))
    again = AutotuneConfig.from_env(config.to_env())
    assert again == config
    assert AutotuneConfig.from_env({}) is None
