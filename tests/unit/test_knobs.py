"""Knob defaults, ranges, parsing and precedence (flag > env > file > default)."""

from __future__ import annotations

import json

import pytest

from raytrain_x import ConfigError, Knobs, load_knobs
from raytrain_x.common.knobs import MB


def test_defaults_and_specs():
    k = Knobs()
    assert k.fusion_threshold_bytes == 64 * MB
    assert k.cycle_time_ms == 1.0
    assert k.cache_capacity == 1024
    assert k.hierarchical_allreduce and not k.hierarchical_allgather  # on where it applies
    specs = Knobs.specs()
    assert specs["fusion_threshold_bytes"].env == "RAYTRAIN_X_FUSION_THRESHOLD"
    assert specs["cycle_time_ms"].flag == "--cycle-time-ms"


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"fusion_threshold_bytes": -1}, "out of range"),
        ({"cycle_time_ms": float("nan")}, "out of range"),
        ({"cache_capacity": 1.5}, "whole number"),
        ({"hierarchical_allreduce": "yes"}, "true or false"),
        ({"cycle_time_ms": "fast"}, "must be a number"),
        ({"bogus": 1}, "unknown knob"),
    ],
)
def test_bad_values_rejected(changes, match):
    with pytest.raises(ConfigError, match=match):
        Knobs().replace(**changes)


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    cfg = tmp_path / "knobs.yaml"
    cfg.write_text("params:\n  fusion_threshold_mb: 8\n  cycle_time_ms: 7\n  cache_capacity: 10\n")
    env = {"RAYTRAIN_X_CYCLE_TIME": "3.5", "RAYTRAIN_X_CACHE_CAPACITY": "20"}
    knobs, fixed = load_knobs(flags={"cache_capacity": 30}, env=env, config_file=cfg)
    assert knobs.fusion_threshold_bytes == 8 * MB  # file
    assert knobs.cycle_time_ms == 3.5  # env beats file
    assert knobs.cache_capacity == 30  # flag beats env
    assert knobs.hierarchical_allreduce is True  # default
    assert fixed == {"fusion_threshold_bytes", "cycle_time_ms", "cache_capacity"}


def test_env_parsing():
    env = {
        "RAYTRAIN_X_FUSION_THRESHOLD": "1048576",
        "RAYTRAIN_X_HIERARCHICAL_ALLREDUCE": "false",
        "RAYTRAIN_X_HIERARCHICAL_ALLGATHER": "1",
    }
    knobs, fixed = load_knobs(env=env)
    assert knobs.fusion_threshold_bytes == MB
    assert knobs.hierarchical_allreduce is False
    assert knobs.hierarchical_allgather is True
    assert "cycle_time_ms" not in fixed


@pytest.mark.parametrize(
    "env,match",
    [
        ({"RAYTRAIN_X_CYCLE_TIME": "soon"}, "RAYTRAIN_X_CYCLE_TIME.*not a number"),
        ({"RAYTRAIN_X_HIERARCHICAL_ALLREDUCE": "maybe"}, "not a boolean"),
        ({"RAYTRAIN_X_CACHE_CAPACITY": "-5"}, "out of range"),
    ],
)
def test_bad_env_rejected(env, match):
    with pytest.raises(ConfigError, match=match):
        load_knobs(env=env)


def test_json_config_and_unknown_key(tmp_path):
    good = tmp_path / "k.json"
    good.write_text(json.dumps({"cycle_time_ms": 2, "hierarchical_allgather": True}))
    knobs, _ = load_knobs(env={}, config_file=good)
    assert knobs.cycle_time_ms == 2.0 and knobs.hierarchical_allgather
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"fusion_treshold": 1}))
    with pytest.raises(ConfigError, match="not a knob; known keys"):
        load_knobs(env={}, config_file=bad)


def test_missing_or_malformed_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_knobs(env={}, config_file=tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="could not be parsed"):
        load_knobs(env={}, config_file=broken)


def test_unknown_flag_rejected():
    with pytest.raises(ConfigError, match="unknown knob 'fusion'"):
        load_knobs(flags={"fusion": 1}, env={})


def test_docs_hold_the_tables_the_settings_make():
    """docs/api.md's tables of variables are `settings.table(...)`, generated from the one
    registry (`python tools/settings_tables.py` prints them)."""
    from pathlib import Path

    from raytrain_x.common import settings

    doc = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    for scope in (settings.USER, settings.LAUNCHER, settings.INTERNAL):
        assert settings.table(scope) in doc, f"docs/api.md's {scope} table is stale: " \
            "paste `python tools/settings_tables.py` into it"


def test_every_variable_the_package_names_is_in_the_registry():
    """No RAYTRAIN_X_ variable is read or set outside `raytrain_x.common.settings`, and
    at most 25 are for users."""
    import re
    from pathlib import Path

    from raytrain_x.common import settings

    root = Path(__file__).resolve().parents[2] / "raytrain_x"
    known = {s.env for s in settings.ALL}
    named = {m for path in root.rglob("*.py")
             for m in re.findall(r"RAYTRAIN_X_[A-Z0-9_]*[A-Z0-9]", path.read_text())}
    assert named <= known, sorted(named - known)
    assert len(settings.of_scope(settings.USER)) <= 26


def test_the_cli_takes_every_flag_the_registry_names():
    from raytrain_x.cli import build_parser
    from raytrain_x.common import settings

    run = build_parser()._subparsers._group_actions[0].choices["run"]
    taken = {option for action in run._actions for option in action.option_strings}
    assert {s.flag for s in settings.flagged()} <= taken


def test_a_setting_reads_its_variable_or_its_default_and_rejects_bad_numbers():
    import pytest

    from raytrain_x.common.errors import ConfigError
    from raytrain_x.common.settings import SHM, TIMEOUT_S

    assert TIMEOUT_S.read({}) == 30.0 and TIMEOUT_S.read({"RAYTRAIN_X_TIMEOUT": "7"}) == 7.0
    assert SHM.read({"RAYTRAIN_X_SHM": "off"}) is False and SHM.read({}) is True
    with pytest.raises(ConfigError, match="RAYTRAIN_X_TIMEOUT='soon' is not a number"):
        TIMEOUT_S.read({"RAYTRAIN_X_TIMEOUT": "soon"})


def test_a_best_config_file_gives_knobs_and_training_settings(tmp_path):
    """autotune_experiments' best_config.json: its `config` holds knobs and the training
    settings (ZeRO stage, micro-batch, accumulation); each reader takes its own."""
    from raytrain_x.common.knobs import read_config_file, read_training_settings
    from raytrain_x.common.training import to_env, training_settings

    best = tmp_path / "best_config.json"
    best.write_text('{"config": {"zero_stage": 1, "micro_batch_size": 32, '
                    '"gradient_accumulation_steps": 2, "cycle_time_ms": 4}, '
                    '"samples_per_sec": 1234.5}')
    assert read_config_file(best) == {"cycle_time_ms": 4.0}
    settings = read_training_settings(best)
    assert settings == {"zero_stage": 1, "micro_batch_size": 32,
                        "gradient_accumulation_steps": 2}
    assert training_settings(to_env(settings)) == settings
    assert training_settings({}) == {}
    bad = tmp_path / "bad.yaml"
    bad.write_text("zero_stage: 3\n")
    with pytest.raises(ConfigError, match="zero_stage must be 0, 1 or 2"):
        read_training_settings(bad)
    with pytest.raises(ConfigError, match="micro_batch_size must be an integer"):
        training_settings({"RAYTRAIN_X_MICRO_BATCH_SIZE": "lots"})


def test_a_flag_in_mb_is_checked_in_its_own_unit():
    # the flag and the `fusion_threshold_mb` key take MB (fractions too), the variable bytes
    knobs, _ = load_knobs(flags={"fusion_threshold_bytes": 0.5}, env={})
    assert knobs.fusion_threshold_bytes == 512 * 1024
    for bad, said in (("-1", "out of range: 0 to 4096 \\(MB\\)"), ("nan", "out of range"),
                      ("lots", "not a number")):
        with pytest.raises(ConfigError, match=f"flag --fusion-threshold-mb='?{bad}'? is {said}"):
            load_knobs(flags={"fusion_threshold_bytes": bad}, env={})
