"""Horovod's HOROVOD_* variables are read as aliases of ours; ours win when both are set."""

from __future__ import annotations

from raytrain_x.common.autotune_config import AutotuneConfig
from raytrain_x.common.horovod_env import ALIASES, with_horovod_aliases
from raytrain_x.common.knobs import load_knobs


def test_horovod_knob_variables_set_our_knobs_and_ours_win():
    knobs, fixed = load_knobs(env={"HOROVOD_FUSION_THRESHOLD": str(8 << 20),
                                   "HOROVOD_CYCLE_TIME": "5", "RAYTRAIN_X_CYCLE_TIME": "2",
                                   "HOROVOD_CACHE_CAPACITY": "0",
                                   "HOROVOD_HIERARCHICAL_ALLREDUCE": "1"})
    assert knobs.fusion_threshold_bytes == 8 << 20
    assert knobs.cycle_time_ms == 2.0  # ours, over Horovod's 5
    assert knobs.cache_capacity == 0 and knobs.hierarchical_allreduce is True
    assert {"fusion_threshold_bytes", "cycle_time_ms", "cache_capacity",
            "hierarchical_allreduce"} <= fixed  # given explicitly: not tuned


def test_horovod_autotune_variables_turn_autotune_on():
    config = AutotuneConfig.from_env({"HOROVOD_AUTOTUNE": "1",
                                      "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "2",
                                      "HOROVOD_AUTOTUNE_LOG": "/tmp/at.csv"})
    assert config is not None and config.warmup_samples == 2
    assert config.log_file == "/tmp/at.csv"
    assert AutotuneConfig.from_env({"HOROVOD_AUTOTUNE_LOG": "/tmp/at.csv"}) is None


def test_every_alias_maps_a_horovod_name_onto_ours():
    for ours, theirs in ALIASES.items():
        assert ours.startswith("RAYTRAIN_X_") and theirs.startswith("HOROVOD_")
        assert ours.removeprefix("RAYTRAIN_X_") == theirs.removeprefix("HOROVOD_")
        assert with_horovod_aliases({theirs: "7"})[ours] == "7"
        assert with_horovod_aliases({theirs: "7", ours: "3"})[ours] == "3"
