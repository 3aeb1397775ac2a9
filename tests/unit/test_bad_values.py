"""Bad setting and argument values are refused where they are read, with one line naming
what to change: never a busy loop, a flood, a wait that never ends or an error from deep
inside."""

from __future__ import annotations

import math

import pytest
import torch

from raytrain_x.autotune.progress import SamplerReport
from raytrain_x.common.autotune_config import AutotuneConfig
from raytrain_x.common.autotune_log import Sample
from raytrain_x.common.errors import ConfigError
from raytrain_x.common.knobs import Knobs
from raytrain_x.common.settings import (
    ALL,
    METRICS_INTERVAL_S,
    STALL_SHUTDOWN_S,
    STALL_WARNING_S,
    TIMEOUT_S,
    check_seconds,
)


@pytest.mark.parametrize("setting,raw", [
    (METRICS_INTERVAL_S, "0"),  # every worker and the driver busy-looped
    (STALL_WARNING_S, "0.5"),  # a warning every few engine cycles
    (TIMEOUT_S, "nan"),  # a NaN wait never ends
    (TIMEOUT_S, "inf"),
    (TIMEOUT_S, "-1"),
    (STALL_SHUTDOWN_S, "0.5"),
])
def test_a_setting_out_of_its_range_is_refused_naming_the_variable(setting, raw):
    with pytest.raises(ConfigError) as err:
        setting.read({setting.env: raw})
    message = str(err.value)
    assert setting.env in message and "\n" not in message
    assert f"unset it for the default {setting.default:g}" in message


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "1e400"])
def test_a_whole_number_setting_refuses_what_is_not_finite_in_one_line(raw):
    # a NaN fusion threshold raised Python's "cannot convert float NaN to integer"
    for setting in ALL:
        if setting.kind is int:
            with pytest.raises(ConfigError, match=f"{setting.env}='{raw}' is out of range"):
                setting.read({setting.env: raw})


def test_settings_in_range_and_documented_zeros_are_taken():
    assert METRICS_INTERVAL_S.read({METRICS_INTERVAL_S.env: "0.5"}) == 0.5
    assert STALL_SHUTDOWN_S.read({STALL_SHUTDOWN_S.env: "0"}) == 0.0  # never
    assert STALL_WARNING_S.read({}) == 60.0
    assert STALL_WARNING_S.read({STALL_WARNING_S.env: "0"}) == 0.0  # no stall check


@pytest.mark.parametrize("value", [math.nan, math.inf, 0, -3, "10", True])
def test_seconds_must_be_finite_positive_numbers(value):
    with pytest.raises(ConfigError, match="timeout_s must be"):
        check_seconds("timeout_s", value)


def test_executor_and_cli_timeouts_refuse_nan_and_inf(capsys):
    from raytrain_x.cli import main
    from raytrain_x.ray import RayExecutor

    with pytest.raises(ConfigError, match="timeout_s must be a finite number"):
        RayExecutor.create_settings(timeout_s=math.nan)
    with pytest.raises(ConfigError, match="placement_group_timeout_s"):
        RayExecutor.create_settings(placement_group_timeout_s=math.inf)
    with pytest.raises(ConfigError, match="elastic_timeout"):
        RayExecutor(min_workers=1, max_workers=2, elastic_timeout=math.nan)
    with pytest.raises(ConfigError, match="cooldown_range"):
        RayExecutor(min_workers=1, max_workers=2, cooldown_range=(1.0, math.inf))
    with pytest.raises(SystemExit) as exit_:
        main(["run", "-np", "1", "--timeout", "nan", "python", "-c", "pass"])
    assert exit_.value.code == 2
    assert "--timeout must be a finite number of seconds" in capsys.readouterr().err


@pytest.mark.parametrize("factor", ["prescale_factor", "postscale_factor"])
def test_a_nan_scale_factor_is_refused_before_anything_is_sent(factor):
    """A NaN never equals itself: the ranks were told they disagree."""
    import raytrain_x.torch as rx

    with pytest.raises(ConfigError, match=f"{factor} must be a finite number"):
        rx.allreduce(torch.ones(3), op=rx.Sum, **{factor: math.nan})


def test_a_log_that_cannot_be_written_ends_the_log_not_the_tuning(tmp_path):
    """A full disk under the autotune log stopped tuning at the last sample, not the best."""
    path = tmp_path / "tune.csv"
    lines: list[str] = []
    report = SamplerReport(AutotuneConfig(log_file=str(path)), lines.append)
    good = Sample(1, Knobs(), 10.0, 5, 1.0, unit="steps/s")
    report.sample(good, "sample", 1, 10.0, 3, False)
    path.unlink()
    path.mkdir()  # writes to it fail as on a full disk
    report.sample(Sample(2, Knobs(), 5.0, 9, 2.0, unit="steps/s"), "sample", 2, 10.0, 2,
                  False)
    report.decided(good, 2, "kept")
    assert any("could not write the log" in line for line in lines), lines
    assert any("done after 2 samples; keeping" in line for line in lines), lines
    path.rmdir()
    assert not path.exists()

