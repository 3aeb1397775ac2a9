"""Autotune settings (`--autotune*` flags, `RAYTRAIN_X_AUTOTUNE*` env)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from raytrain_x.common.errors import ConfigError
from raytrain_x.common.horovod_env import with_horovod_aliases
from raytrain_x.common.knobs import Knobs

# field -> (env variable, CLI flag)
_NAMES = {
    "log_file": ("RAYTRAIN_X_AUTOTUNE_LOG", "--autotune-log-file"),
    "warmup_samples": ("RAYTRAIN_X_AUTOTUNE_WARMUP_SAMPLES", "--autotune-warmup-samples"),
    "steps_per_sample": ("RAYTRAIN_X_AUTOTUNE_STEPS_PER_SAMPLE", "--autotune-steps-per-sample"),
    "bayes_opt_max_samples": ("RAYTRAIN_X_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
                              "--autotune-bayes-opt-max-samples"),
    "gaussian_process_noise": ("RAYTRAIN_X_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
                               "--autotune-gaussian-process-noise"),
    "warmup_time_s": ("RAYTRAIN_X_AUTOTUNE_WARMUP_TIME", "--autotune-warmup-time"),
    "sampling_time_s": ("RAYTRAIN_X_AUTOTUNE_SAMPLING_TIME", "--autotune-sampling-time"),
    "convergence_patience": ("RAYTRAIN_X_AUTOTUNE_CONVERGENCE_PATIENCE",
                             "--autotune-convergence-patience"),
    "resume_from": ("RAYTRAIN_X_AUTOTUNE_RESUME_FROM", "--autotune-resume-from"),
    "confirm_top": ("RAYTRAIN_X_AUTOTUNE_CONFIRM_TOP", "--autotune-confirm-top"),
    "early_stop_ratio": ("RAYTRAIN_X_AUTOTUNE_EARLY_STOP_RATIO", "--autotune-early-stop-ratio"),
}


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
        warmup_time_s / sampling_time_s: time-based warmup and sampling instead of counts.
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
        initial_knobs: where the search starts (measured first); not fixed.
        resume_from: a log CSV or knobs JSON: start at its best knobs and do not tune.
        seed: random state of the search.
    """

    log_file: str | None = None
    warmup_samples: int = 3
    steps_per_sample: int = 10
    bayes_opt_max_samples: int = 20
    gaussian_process_noise: float = 0.8
    warmup_time_s: float | None = None
    sampling_time_s: float | None = None
    convergence_patience: int = 8
    min_improvement: float = 0.02
    confirm_top: int = 2
    sub_windows: int = 3
    early_stop_ratio: float = 0.9
    initial_knobs: Knobs | None = None
    resume_from: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.warmup_samples >= 0, "warmup_samples must be >= 0"),
            (self.steps_per_sample >= 1, "steps_per_sample must be >= 1"),
            (self.bayes_opt_max_samples >= 1, "bayes_opt_max_samples must be >= 1"),
            (self.gaussian_process_noise >= 0, "gaussian_process_noise must be >= 0"),
            (self.warmup_time_s is None or self.warmup_time_s >= 0, "warmup_time must be >= 0"),
            (self.sampling_time_s is None or self.sampling_time_s > 0,
             "sampling_time must be > 0"),
            (self.convergence_patience >= 0, "convergence_patience must be >= 0"),
            (self.confirm_top >= 0, "confirm_top must be >= 0"),
            (self.sub_windows >= 1, "sub_windows must be >= 1"),
            (0 <= self.early_stop_ratio < 1, "early_stop_ratio must be in [0, 1)"),
            (self.initial_knobs is None or isinstance(self.initial_knobs, Knobs),
             "initial_knobs must be a Knobs"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"autotune: {message}")
        if self.resume_from is not None and not os.path.exists(self.resume_from):
            raise ConfigError(f"autotune resume file {self.resume_from!r} does not exist")

    def to_env(self) -> dict[str, str]:
        """Environment that recreates this config in a worker process."""
        env = {"RAYTRAIN_X_AUTOTUNE": "1"}
        for name, (var, _) in _NAMES.items():
            value = getattr(self, name)
            if value is not None:
                env[var] = str(os.path.abspath(value) if name in ("log_file", "resume_from")
                               else value)
        if self.initial_knobs is not None:
            import json

            env["RAYTRAIN_X_AUTOTUNE_INITIAL_KNOBS"] = json.dumps(self.initial_knobs.to_dict())
        return env

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None) -> AutotuneConfig | None:
        """The config the environment asks for, or None when autotune is off."""
        env = with_horovod_aliases(os.environ if env is None else env)
        if env.get("RAYTRAIN_X_AUTOTUNE", "").lower() not in ("1", "true", "yes", "on") \
                and not env.get("RAYTRAIN_X_AUTOTUNE_RESUME_FROM"):
            return None
        kwargs: dict[str, Any] = {}
        types = {f.name: f.type for f in dataclasses.fields(AutotuneConfig)}
        for name, (var, _) in _NAMES.items():
            raw = env.get(var)
            if raw in (None, ""):
                continue
            kind = types[name]
            try:
                if "int" in kind:
                    kwargs[name] = int(float(raw))
                elif "float" in kind:
                    kwargs[name] = float(raw)
                else:
                    kwargs[name] = raw
            except ValueError:
                raise ConfigError(f"environment {var}={raw!r} is not a number") from None
        initial = env.get("RAYTRAIN_X_AUTOTUNE_INITIAL_KNOBS")
        if initial:
            import json

            kwargs["initial_knobs"] = Knobs(**json.loads(initial))
        return AutotuneConfig(**kwargs)

    @staticmethod
    def flag_names() -> dict[str, str]:
        """Field -> CLI flag."""
        return {name: flag for name, (_, flag) in _NAMES.items()}
