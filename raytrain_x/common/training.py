"""Training settings a config file can carry beside the knobs: the ZeRO stage, the
micro-batch size and the gradient accumulation steps, as `autotune_experiments(...,
search="zero")` writes them to `best_config.json`.

`raytrain-x run --config-file F` and `RaytrainXTrainer`'s `RaytrainXConfig(config_file=F)`
hand them to every worker as environment variables; there `DistributedOptimizer` takes
its default `zero_stage` from them, and the training function reads the rest with
`raytrain_x.training_settings()` (as a DeepSpeed script reads its config's
`train_micro_batch_size_per_gpu`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from raytrain_x.common import settings
from raytrain_x.common.errors import ConfigError

# config key -> the variable that hands it to the workers
ENV = {s.config_key: s.env for s in (settings.ZERO_STAGE, settings.MICRO_BATCH_SIZE,
                                     settings.GRADIENT_ACCUMULATION_STEPS)}


def check(name: str, value: Any, source: str) -> int:
    """`value` as the setting `name` takes it; ConfigError naming `source` otherwise."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = None
    if number is None or isinstance(value, bool) or str(number) != str(value).strip():
        raise ConfigError(f"{source}: {name} must be an integer, got {value!r}")
    if name == "zero_stage" and number not in (0, 1, 2):
        raise ConfigError(f"{source}: zero_stage must be 0, 1 or 2, got {number}")
    if name != "zero_stage" and number < 1:
        raise ConfigError(f"{source}: {name} must be >= 1, got {number}")
    return number


def from_mapping(data: Mapping[str, Any], source: str) -> dict[str, int]:
    """The training settings among `data`'s keys (the others are left to the knobs)."""
    return {name: check(name, data[name], f"{source} key {name!r}")
            for name in ENV if name in data}


def to_env(settings: Mapping[str, int]) -> dict[str, str]:
    """Environment variables that hand `settings` to the workers."""
    return {ENV[name]: str(value) for name, value in settings.items()}


def training_settings(env: Mapping[str, str] | None = None) -> dict[str, int]:
    """The training settings this worker was given (by a config file through `raytrain-x
    run --config-file` or `RaytrainXConfig(config_file=...)`): a dict with any of
    `zero_stage`, `micro_batch_size` and `gradient_accumulation_steps`, empty when none.

    Example: `mbs = raytrain_x.training_settings().get("micro_batch_size", 32)`.
    """
    env = os.environ if env is None else env
    return {name: check(name, env[var], f"environment {var}")
            for name, var in ENV.items() if env.get(var, "") != ""}
