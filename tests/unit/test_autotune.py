"""Autotune logic: search space, controller guarantees, log schema, resume (no processes)."""

from __future__ import annotations

import csv
import json
import math
import time

import pytest

from raytrain_x import ConfigError, Knobs
from raytrain_x.autotune.controller import AutotuneController, SearchSpace
from raytrain_x.autotune.sampler import AutotuneSampler
from raytrain_x.common.autotune_config import AutotuneConfig, SearchRules
from raytrain_x.common.autotune_log import COLUMNS, AutotuneLog, Sample, load_best_knobs
from raytrain_x.common.knobs import MB
from raytrain_x.engine.messages import Meta, Response


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
    config = AutotuneConfig(bayes_opt_max_samples=5, rules=SearchRules(min_improvement=0.05))
    controller = AutotuneController(config, start, frozenset())
    _drive(controller, score=lambda k: 100.0 if k == start else 103.0)  # +3% is noise
    assert controller.best()[0] == start


def test_search_improves_a_bad_start_and_stops_at_max_samples():
    start = Knobs(fusion_threshold_bytes=0, cycle_time_ms=40.0)
    config = AutotuneConfig(bayes_opt_max_samples=12, rules=SearchRules(convergence_patience=0))
    controller = AutotuneController(config, start, frozenset({"hierarchical_allreduce",
                                                              "hierarchical_allgather"}))
    measured = _drive(controller)
    # the search stops 3 samples early (2 x confirm_top, at most a quarter of 12) ...
    assert len(set(measured[:9])) == 9  # ... and never spends a sample on a repeat
    ranked = sorted(set(measured[:9]), key=_score, reverse=True)
    assert measured[9:11] == ranked[:2]  # then the top 2 are measured again: confirmed
    assert measured[11] == start  # and the start once more, late, as the candidates were
    assert len(measured) == 12  # within bayes_opt_max_samples
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

    config = AutotuneConfig(bayes_opt_max_samples=8, rules=SearchRules(convergence_patience=0))
    controller = AutotuneController(config, start, frozenset())
    _drive(controller, score=noisy)
    lucky, steady = order[1], order[2]
    assert times[lucky] == 2 and times[steady] == 2  # both candidates measured twice
    assert controller.best() == (steady, 110.0)  # by mean: 110 beats (130 + 80) / 2
    assert controller.current == steady


def test_convergence_stops_early():
    config = AutotuneConfig(bayes_opt_max_samples=50, rules=SearchRules(convergence_patience=3))
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
                            bayes_opt_max_samples=2,
                            rules=SearchRules(sub_windows=3, convergence_patience=0))
    controller = AutotuneController(config, Knobs(), frozenset({"hierarchical_allreduce",
                                                                "hierarchical_allgather"}))
    requested: list[Knobs] = []
    lines: list[str] = []
    sampler = AutotuneSampler(config, controller, requested.append, lines.append)  # background
    knobs = Knobs()
    step = 0
    while not sampler.done and step < 20000:
        step += 1
        if sampler._answer is not None:  # asked in the background: training goes on
            time.sleep(0.001)
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


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _bucket(name: str) -> Response:
    return Response(name, Meta("allreduce", "float32", (1024,), "average", fuse=False))


def _run_marked(sampler, clock, step_s, cycles=2000, stop=lambda s: s.finished):
    """Drives `sampler` as an engine would: two bucket cycles per step, a mark per step.
    `step_s(knobs)` is how long a step takes at those knobs."""
    knobs, requested = Knobs(), sampler.request_knobs.__self__
    for i in range(cycles):
        if requested and knobs != requested[-1]:
            knobs = requested[-1]
        clock.now += step_s(knobs) / 2
        sampler.on_cycle(knobs, i, [_bucket("grad.bucket0")])
        clock.now += step_s(knobs) / 2
        sampler.on_cycle(knobs, i, [_bucket("grad.bucket1")])
        sampler.mark_step()
        if stop(sampler):
            return knobs
    raise AssertionError("the sampler never finished")


def _marked_sampler(tmp_path, bayes_opt_max_samples, **rules):
    config = AutotuneConfig(log_file=str(tmp_path / "tune.csv"), warmup_samples=1,
                            steps_per_sample=3, bayes_opt_max_samples=bayes_opt_max_samples,
                            rules=SearchRules(sub_windows=3, **rules))
    clock = _Clock()
    lines: list[str] = []
    sampler = AutotuneSampler(config, AutotuneController(config, Knobs(), frozenset()), [].append,
                              lines.append, clock=clock, background=False)
    sampler.observer.fusable = True  # gradients that fuse: the fusion threshold is searched
    return sampler, clock, lines


def test_step_marks_drive_the_score(tmp_path):
    sampler, clock, lines = _marked_sampler(tmp_path, bayes_opt_max_samples=3,
                                            convergence_patience=0, early_stop_ratio=0)
    sampler.samples_per_step = 32  # rx.autotune_batch_size(16) on 2 workers
    _run_marked(sampler, clock, lambda k: 0.1 if k == Knobs() else 0.08)
    rows = list(csv.DictReader((tmp_path / "tune.csv").open()))
    scored = [r for r in rows if r["kind"] == "sample"]
    assert all(r["unit"] == "samples/s" for r in rows if r["kind"] != "after")
    # the start: 0.1 s per step, 32 samples per step -> 320 samples/s
    assert float(scored[0]["score"]) == pytest.approx(320.0)
    assert float(scored[1]["score"]) == pytest.approx(400.0)  # 0.08 s per step
    assert any("score in samples/s" in line for line in lines)


def test_dimensions_that_cannot_matter_are_not_searched(tmp_path):
    from raytrain_x.autotune.observer import BATCHING_FIXED_BUCKETS, BATCHING_RUNS, JobShape

    sampler, clock, lines = _marked_sampler(tmp_path, bayes_opt_max_samples=3)
    _run_marked(sampler, clock, lambda k: 0.1, stop=lambda s: s.searched is not None)
    # one host: no hierarchy; 2 names fit the cache; gradients fuse up to the threshold
    assert sampler.searched == ["fusion_threshold_bytes", "cycle_time_ms"]
    assert set(sampler.advisor.free_knobs) == {"fusion_threshold_bytes", "cycle_time_ms"}
    assert any("searching fusion_threshold_bytes, cycle_time_ms" in line
               and "hierarchical_allreduce: needs several hosts" in line for line in lines)
    rows = list(csv.DictReader((tmp_path / "tune.csv").open()))
    assert rows[1]["searched"] == "fusion_threshold_bytes+cycle_time_ms"

    config = AutotuneConfig()
    controller = AutotuneController(config, Knobs(cache_capacity=2),
                                    frozenset({"cycle_time_ms"}))
    fixed = AutotuneSampler(config, controller, [].append, [].append,
                            shape=JobShape(4, True, True))
    fixed.batching.add(BATCHING_FIXED_BUCKETS)  # bucket_cap_mb given by the user
    fixed.observer.observe([_bucket(f"grad.bucket{i}") for i in range(3)])
    fixed.searched, fixed.left_out = fixed.relevant_dimensions(Knobs(cache_capacity=2))
    fixed._ask(1.0, first=True)
    assert fixed.searched == ["cache_capacity", "hierarchical_allreduce"]  # 3 names > 2
    assert controller.free_knobs == fixed.searched
    assert "bucket_cap_mb" in fixed.left_out["fusion_threshold_bytes"]
    assert fixed.left_out["cycle_time_ms"] == "fixed by the user"
    assert fixed.left_out["hierarchical_allgather"] == "no allgather"
    no_shm = AutotuneSampler(config, None, [].append, shape=JobShape(4, True, False))
    no_shm.observer.observe([_response("a"), _response("b")])
    left_out = no_shm.relevant_dimensions(Knobs())[1]
    assert left_out["hierarchical_allreduce"] == "some host's workers cannot share memory"
    lone = AutotuneSampler(config, None, [].append)
    lone.observer.observe([_response("done4")])  # a metric allreduce alone in its cycle
    assert "fusion_threshold_bytes" not in lone.relevant_dimensions(Knobs())[0]
    # DistributedOptimizer's runs are cut at the threshold: searched, though the engine
    # fuses none of them
    runs = AutotuneSampler(config, None, [].append)
    runs.batching.add(BATCHING_RUNS)
    runs.observer.observe([_bucket("grad.a..b")])
    assert "fusion_threshold_bytes" in runs.relevant_dimensions(Knobs())[0]
    per_tensor = AutotuneSampler(AutotuneConfig(), None, [].append)
    per_tensor.observer.observe([_response("a"), _response("b")])  # fusable requests
    assert "fusion_threshold_bytes" in per_tensor.relevant_dimensions(Knobs())[0]


def test_a_clearly_worse_sample_stops_after_one_sub_window(tmp_path):
    sampler, clock, lines = _marked_sampler(tmp_path, bayes_opt_max_samples=6,
                                            convergence_patience=0)
    # every setting but the start is 3x slower: each is cut after its first sub-window
    _run_marked(sampler, clock, lambda k: 0.1 if k == Knobs() else 0.3)
    rows = list(csv.DictReader((tmp_path / "tune.csv").open()))
    search = [r for r in rows if r["kind"] == "sample"][1:]
    assert search and all(float(r["score"]) == pytest.approx(1 / 0.3, rel=1e-3) for r in search)
    assert sum("stopped early" in line for line in lines) == len(search)
    steps = [int(r["engine_step"]) for r in rows if r["kind"] == "sample"]
    # a cut sample takes 1 step and the switch 2, a full one 3 + 2
    assert all(b - a == 3 for a, b in zip(steps[1:], steps[2:]))


def test_the_cost_of_tuning_is_measured_after_it(tmp_path):
    sampler, clock, lines = _marked_sampler(tmp_path, bayes_opt_max_samples=4,
                                            convergence_patience=0, early_stop_ratio=0)
    final = _run_marked(sampler, clock, lambda k: 0.1 if k.cycle_time_ms > 0.5 else 0.05)
    assert sampler.done and sampler.finished
    cost = sampler.cost
    assert cost.after_step_s == pytest.approx(0.05 if final.cycle_time_ms <= 0.5 else 0.1)
    # every tuning step took 0.05 or 0.1 s, so the cost lies between 1x and 2x
    assert 1.0 <= cost.ratio <= 2.0 and cost.tuning_steps >= 4 * 3
    rows = list(csv.DictReader((tmp_path / "tune.csv").open()))
    assert [r["kind"] for r in rows][-2:] == ["best", "after"]
    assert float(rows[-1]["cost"]) == pytest.approx(cost.ratio, rel=1e-3)
    assert any("cost" in line and "the start" in line for line in lines)


def test_a_missing_extra_is_a_config_error_naming_it():
    from raytrain_x.common.errors import ConfigError
    from raytrain_x.common.extras import import_extra

    assert import_extra("json", "tune", "x").dumps([]) == "[]"
    with pytest.raises(ConfigError, match=r"autotune-report needs rtx_not_installed, which is "
                                          r"not installed; .*'tune' extra: pip install "
                                          r'"raytrain-x\[tune\]"'):
        import_extra("rtx_not_installed", "tune", "autotune-report")


def test_switches_are_probed_flipped_right_after_the_start():
    start = Knobs()
    config = AutotuneConfig(bayes_opt_max_samples=10, rules=SearchRules(convergence_patience=0))
    controller = AutotuneController(config, start, frozenset({"cache_capacity"}))

    def score(k: Knobs) -> float:  # flat allreduce is a step up here, at any bucket size
        return _score(k) * (1.0 if k.hierarchical_allreduce else 2.0)

    measured = _drive(controller, score=score)
    assert measured[:3] == [start, start.replace(hierarchical_allreduce=False),
                            start.replace(hierarchical_allgather=True)]
    assert len(set(measured[:3])) == 3
    assert not controller.best()[0].hierarchical_allreduce


def test_the_sampler_goes_through_its_named_phases(tmp_path):
    from raytrain_x.autotune.sampler import Phase

    sampler, clock, _ = _marked_sampler(tmp_path, bayes_opt_max_samples=4,
                                        convergence_patience=0, early_stop_ratio=0)
    phases: list = []

    def stop(s) -> bool:
        if not phases or phases[-1] is not s.phase:
            phases.append(s.phase)
        return s.finished

    _run_marked(sampler, clock, lambda k: 0.1 if k == Knobs() else 0.12, stop=stop)
    assert phases[0] is Phase.WARMUP and phases[-1] is Phase.DONE
    order = [p for p in (Phase.WARMUP, Phase.SCORING, Phase.SWITCHING, Phase.COST,
                         Phase.DONE) if p in phases]
    assert order == [Phase.WARMUP, Phase.SCORING, Phase.SWITCHING, Phase.COST, Phase.DONE]
    assert phases.index(Phase.COST) > max(i for i, p in enumerate(phases)
                                          if p is Phase.SCORING)
