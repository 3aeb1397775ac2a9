"""Autotune settings: `AutotuneConfig` (the `--autotune*` flags, `RAYTRAIN_X_AUTOTUNE*`
variables, as Horovod and Bagua name them) and the search's own rules (`SearchRules`)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from raytrain_x.common import settings
from raytrain_x.common.errors import ConfigError
from raytrain_x.common.knobs import Knobs

# field -> its setting (variable and flag)
_SETTINGS = {
    "log_file": settings.AUTOTUNE_LOG,
    "warmup_samples": settings.AUTOTUNE_WARMUP_SAMPLES,
    "steps_per_sample": settings.AUTOTUNE_STEPS_PER_SAMPLE,
    "bayes_opt_max_samples": settings.AUTOTUNE_MAX_SAMPLES,
    "gaussian_process_noise": settings.AUTOTUNE_NOISE,
    "warmup_time_s": settings.AUTOTUNE_WARMUP_TIME,
    "sampling_time_s": settings.AUTOTUNE_SAMPLING_TIME,
    "resume_from": settings.AUTOTUNE_RESUME_FROM,
}


def _check(checks: list[tuple[bool, str]]) -> None:
    """The first of `checks` that does not hold, as a `ConfigError`."""
    for ok, message in checks:
        if not ok:
            raise ConfigError(f"autotune: {message}")


@dataclass(frozen=True)
class SearchRules:
    """How the search decides: fixed rules, not options (the defaults are what the
    benchmarks in docs/autotune.md measured); tests and experiments change them.

    Attributes:
        convergence_patience: stop early after this many scored samples without a gain
            beyond `min_improvement` over the best so far (0 = never early).
        min_improvement: relative gain that counts as an improvement (noise floor).
        confirm_top: before deciding, the best this-many settings are measured again until
            each has two measurements (within `bayes_opt_max_samples`), and the choice is
            made among confirmed settings and the start by mean score, so one lucky sample
            cannot win (0 = decide on single samples).
        sub_windows: each sample's score is the median over this many sub-windows.
        early_stop_ratio: a search sample whose first sub-window scores below this fraction
            of the best mean so far ends there: the rest would only cost training time
            (0 = measure every sample fully). Leaders being confirmed are never cut.
    """

    convergence_patience: int = 8
    min_improvement: float = 0.02
    confirm_top: int = 2
    sub_windows: int = 3
    early_stop_ratio: float = 0.9

    def __post_init__(self) -> None:
        checks = [
            (self.convergence_patience >= 0, "convergence_patience must be >= 0"),
            (self.min_improvement >= 0, "min_improvement must be >= 0"),
            (self.confirm_top >= 0, "confirm_top must be >= 0"),
            (self.sub_windows >= 1, "sub_windows must be >= 1"),
            (0 <= self.early_stop_ratio < 1, "early_stop_ratio must be in [0, 1)"),
        ]
        _check(checks)


@dataclass
class AutotuneConfig:
    """How the knobs are tuned while training runs.

    Attributes:
        log_file: CSV with one row per sample and a final `best` row (rank 0 writes it).
        warmup_samples: samples measured and discarded first (the job is still warming up).
        steps_per_sample: training steps per sample (a step ends at a step mark, which
            `DistributedOptimizer.step()` sets; without marks, when a tensor name repeats);
            ignored when `sampling_time_s` is set.
        bayes_opt_max_samples: scored samples at most, the starting knobs included.
        gaussian_process_noise: the GP's alpha (noise of the standardised scores).
        warmup_time_s / sampling_time_s: time-based warmup and sampling instead of counts
            (Bagua's); None counts samples and steps.
        initial_knobs: where the search starts (measured first); not fixed.
        resume_from: a log CSV or knobs JSON: start at its best knobs and do not tune.
        seed: random state of the search.
        rules: how the search decides (`SearchRules`; fixed unless an experiment changes
            them).
    """

    log_file: str | None = None
    warmup_samples: int = settings.AUTOTUNE_WARMUP_SAMPLES.default
    steps_per_sample: int = settings.AUTOTUNE_STEPS_PER_SAMPLE.default
    bayes_opt_max_samples: int = settings.AUTOTUNE_MAX_SAMPLES.default
    gaussian_process_noise: float = settings.AUTOTUNE_NOISE.default
    warmup_time_s: float | None = None
    sampling_time_s: float | None = None
    initial_knobs: Knobs | None = None
    resume_from: str | None = None
    seed: int = 0
    rules: SearchRules = field(default_factory=SearchRules)

    def __post_init__(self) -> None:
        checks = [
            (self.warmup_samples >= 0, "warmup_samples must be >= 0"),
            (self.steps_per_sample >= 1, "steps_per_sample must be >= 1"),
            (self.bayes_opt_max_samples >= 1, "bayes_opt_max_samples must be >= 1"),
            (self.gaussian_process_noise >= 0, "gaussian_process_noise must be >= 0"),
            (self.warmup_time_s is None or self.warmup_time_s >= 0, "warmup_time must be >= 0"),
            (self.sampling_time_s is None or self.sampling_time_s > 0,
             "sampling_time must be > 0"),
            (self.initial_knobs is None or isinstance(self.initial_knobs, Knobs),
             "initial_knobs must be a Knobs"),
            (isinstance(self.rules, SearchRules), "rules must be a SearchRules"),
        ]
        _check(checks)
        if self.resume_from is not None and not os.path.exists(self.resume_from):
            raise ConfigError(f"autotune resume file {self.resume_from!r} does not exist")

    def to_env(self) -> dict[str, str]:
        """Environment that recreates this config in a worker process."""
        env = {settings.AUTOTUNE.env: "1"}
        for name, setting in _SETTINGS.items():
            value = getattr(self, name)
            if value is not None:
                env[setting.env] = str(os.path.abspath(value) if setting.kind is str
                                       else value)
        if self.initial_knobs is not None:
            env[settings.AUTOTUNE_INITIAL_KNOBS.env] = json.dumps(self.initial_knobs.to_dict())
        if self.rules != SearchRules():
            env[settings.AUTOTUNE_RULES.env] = json.dumps(dataclasses.asdict(self.rules))
        return env

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None) -> AutotuneConfig | None:
        """The config the environment asks for, or None when autotune is off."""
        env = os.environ if env is None else env
        if not settings.AUTOTUNE.read(env) and settings.AUTOTUNE_RESUME_FROM.raw(env) is None:
            return None
        kwargs: dict[str, Any] = {}
        for name, setting in _SETTINGS.items():
            if setting.raw(env) is not None:
                value = setting.read(env)
                kwargs[name] = None if setting.seconds and value == 0 else value
        initial = settings.AUTOTUNE_INITIAL_KNOBS.raw(env)
        if initial:
            kwargs["initial_knobs"] = Knobs(**json.loads(initial))
        rules = settings.AUTOTUNE_RULES.raw(env)
        if rules:
            kwargs["rules"] = SearchRules(**json.loads(rules))
        return AutotuneConfig(**kwargs)

    @staticmethod
    def field_settings() -> dict[str, settings.Setting]:
        """Field -> its setting (variable and `raytrain-x run` flag)."""
        return dict(_SETTINGS)

    def fields(self) -> dict[str, Any]:
        """Field -> value, one level deep (`rules` stays a `SearchRules`)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
