"""The autotune controller as a Ray actor, so that the search runs beside the workers."""

from __future__ import annotations

import ray

from raytrain_x.autotune.host import BackgroundController
from raytrain_x.common.autotune_config import AutotuneConfig
from raytrain_x.common.knobs import Knobs, load_knobs
from raytrain_x.common.settings import CONFIG_FILE
from raytrain_x.ray.placement import stable_node_strategy


def start_controller_actor(config: AutotuneConfig, start: Knobs, fixed: frozenset[str]):
    """Starts the controller as a Ray actor (no CPU reserved) on a node that stays."""
    return ray.remote(num_cpus=0)(BackgroundController).options(
        scheduling_strategy=stable_node_strategy()).remote(config, start, fixed)


def start_autotune(config: AutotuneConfig, knobs: Knobs | None) -> tuple[dict[str, str], object]:
    """Starts the controller actor for a job whose user fixed `knobs` (None: the env and
    config file say). Returns the env that gives every worker the same starting knobs and
    autotune settings, and the actor (None when `resume_from` means no search)."""
    if knobs is not None:
        base, fixed = knobs, frozenset(Knobs.specs())
    else:
        base, fixed = load_knobs(config_file=CONFIG_FILE.read() or None)
    start = base
    if config.initial_knobs is not None:
        start = config.initial_knobs.replace(**{n: getattr(base, n) for n in fixed})
    if config.resume_from:  # workers read the resume file themselves
        return {**config.to_env(), **(knob_env(knobs) if knobs else {})}, None
    return {**config.to_env(), **knob_env(start)}, start_controller_actor(config, start, fixed)


def fixed_knob_env(knobs: Knobs, fixed: frozenset[str]) -> dict[str, str]:
    """Env for the knobs the user fixed only, so launched ranks see the same fixed set."""
    specs = Knobs.specs()
    return {specs[name].env: value for name, value in
            zip(specs, knob_env(knobs).values()) if name in fixed}


def knob_env(knobs: Knobs) -> dict[str, str]:
    """Environment variables that set every knob to its value in `knobs`."""
    return {spec.env: str(int(value) if isinstance(value, bool) else value)
            for (name, spec), value in zip(Knobs.specs().items(), knobs.to_dict().values())}
