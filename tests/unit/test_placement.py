"""Rank layout from node placement, knob env export and CLI knob resolution (pure logic)."""

from __future__ import annotations

import pytest

from raytrain_x import ConfigError, Knobs
from raytrain_x.cli import build_parser, resolve_knobs
from raytrain_x.common.knobs import MB
from raytrain_x.ray.autotune_actor import fixed_knob_env, knob_env
from raytrain_x.ray.placement import assign_ranks, validate_shape


def test_ranks_are_contiguous_per_node_and_node_order_follows_first_worker():
    slots = assign_ranks(["b", "a", "b", "a", "c"])
    by_index = [(s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots]
    assert by_index == [(0, 0, 2, 0, 3), (2, 0, 2, 1, 3), (1, 1, 2, 0, 3), (3, 1, 2, 1, 3),
                        (4, 0, 1, 2, 3)]
    assert sorted(s.rank for s in slots) == list(range(5))


def test_single_node():
    slots = assign_ranks(["n"] * 3)
    assert [s.local_rank for s in slots] == [0, 1, 2]
    assert {s.cross_size for s in slots} == {1}


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_workers": None, "num_hosts": None}, "exactly one"),
        ({"num_workers": 2, "num_hosts": 2}, "exactly one"),
        ({"num_workers": 0}, "num_workers must be >= 1"),
        ({"num_workers": 1, "cpus_per_worker": 0}, "cpus_per_worker"),
        ({"num_workers": 1, "gpus_per_worker": 1}, "needs use_gpu"),
        ({"num_hosts": 1, "num_workers_per_host": 0}, "num_workers_per_host"),
    ],
)
def test_bad_shapes(kwargs, match):
    args = {"num_workers": None, "num_hosts": None, "num_workers_per_host": 1,
            "cpus_per_worker": 1, "gpus_per_worker": None, "use_gpu": False, **kwargs}
    with pytest.raises(ConfigError, match=match):
        validate_shape(**args)


def test_knob_env_round_trips_through_load():
    from raytrain_x import load_knobs

    knobs = Knobs(fusion_threshold_bytes=3 * MB, cycle_time_ms=2.5, cache_capacity=7,
                  hierarchical_allreduce=True)
    loaded, fixed = load_knobs(env=knob_env(knobs))
    assert loaded == knobs
    assert fixed == set(Knobs.specs())


def test_cli_flags_convert_units_and_beat_env(monkeypatch):
    monkeypatch.setenv("RAYTRAIN_X_CYCLE_TIME", "9")
    monkeypatch.setenv("RAYTRAIN_X_CACHE_CAPACITY", "11")
    args = build_parser().parse_args(["run", "-np", "2", "--fusion-threshold-mb", "2",
                                      "--cycle-time-ms", "3", "--no-hierarchical-allreduce",
                                      "python", "t.py", "--lr", "1"])
    knobs, fixed = resolve_knobs(args)
    assert knobs.fusion_threshold_bytes == 2 * MB
    assert knobs.cycle_time_ms == 3.0 and knobs.cache_capacity == 11
    assert "hierarchical_allreduce" in fixed
    assert args.command == ["python", "t.py", "--lr", "1"]


def test_fixed_knob_env_holds_only_the_fixed_knobs():
    knobs = Knobs(cycle_time_ms=2.5, hierarchical_allreduce=True)
    env = fixed_knob_env(knobs, frozenset({"cycle_time_ms", "hierarchical_allreduce"}))
    assert env == {"RAYTRAIN_X_CYCLE_TIME": "2.5", "RAYTRAIN_X_HIERARCHICAL_ALLREDUCE": "1"}
