"""What autotune's sampler tells its user: a progress line per event, and a row per sample
in the log file."""

from __future__ import annotations

from collections.abc import Callable

from raytrain_x.common.autotune_config import AutotuneConfig
from raytrain_x.common.autotune_log import AutotuneLog, Sample, TuningCost
from raytrain_x.common.knobs import MB, Knobs
from raytrain_x.common.logs import progress_logger


def describe(knobs: Knobs) -> str:
    """Knobs as a progress line shows them."""
    return (f"bucket/fusion {knobs.fusion_threshold_bytes / MB:g} MB, cycle "
            f"{knobs.cycle_time_ms:g} ms, cache {knobs.cache_capacity}, hier ar/ag "
            f"{int(knobs.hierarchical_allreduce)}/{int(knobs.hierarchical_allgather)}")


class SamplerReport:
    """What the sampler tells its user: a progress line per event, and a row per sample in
    the log file (when the config names one)."""

    def __init__(self, config: AutotuneConfig, emit: Callable[[str], None] | None) -> None:
        self.config = config
        self.emit = emit or progress_logger("raytrain_x.autotune.progress").info
        self.log = AutotuneLog(config.log_file) if config.log_file else None

    @staticmethod
    def fmt(score: float, unit: str) -> str:
        if unit == "bytes/s":
            return f"{score / 1e6:.1f} MB/s"
        return f"{score:.3g} {unit}"

    def _logged(self, write: Callable[[], object]) -> object:
        """Runs a write to the log file; one that fails (a full disk, a removed folder)
        warns once and ends the log, never the tuning: the best knobs are still chosen."""
        if self.log is None:
            return None
        try:
            return write()
        except OSError as exc:
            self.emit(f"raytrain-x autotune: could not write the log {self.log.path} ({exc}); "
                      "tuning goes on without it")
            self.log = None
            return None

    def warmup(self, sample: Sample) -> None:
        self._logged(lambda: self.log.append(sample, "warmup"))
        self.emit(f"raytrain-x autotune: warmup sample {sample.index}: {describe(sample.knobs)} "
                  f"-> {self.fmt(sample.score, sample.unit)} (discarded)")

    def searching(self, searched: list[str], left_out: dict[str, str], unit: str) -> None:
        skipped = "; ".join(f"{n}: {why}" for n, why in left_out.items())
        self.emit(f"raytrain-x autotune: searching {', '.join(searched) or 'nothing'}"
                  f"{' (left out: ' + skipped + ')' if skipped else ''}; score in {unit}")

    def sample(self, sample: Sample, kind: str, scored: int, best: float, left: int,
               cut: bool) -> None:
        self._logged(lambda: self.log.append(sample, kind))
        again = " (a candidate measured again)" if kind == "confirm" else ""
        stopped = " (stopped early: far below the best)" if cut else ""
        unit = sample.unit
        self.emit(f"raytrain-x autotune: sample {scored}/{self.config.bayes_opt_max_samples}"
                  f"{again}: {describe(sample.knobs)} -> {self.fmt(sample.score, unit)}"
                  f"{stopped} (best {self.fmt(best, unit)}, {left} left)")

    def decided(self, best: Sample, samples: int, verdict: str) -> None:
        knobs_file = self._logged(lambda: self.log.finish(best))
        if knobs_file is not None:
            self.emit(f"raytrain-x autotune: log {self.log.path}, knobs {knobs_file}")
        self.emit(f"raytrain-x autotune: done after {samples} samples; keeping "
                  f"{describe(best.knobs)} ({self.fmt(best.score, best.unit)} mean, {verdict})")

    def cost(self, best: Sample, cost: TuningCost, per_step: float) -> None:
        self._logged(lambda: self.log.finish_cost(best, cost))
        self.emit(f"raytrain-x autotune: tuning took {cost.tuning_s:.1f} s for "
                  f"{cost.tuning_steps} steps; the same steps at the chosen knobs take "
                  f"{cost.tuning_steps * per_step:.1f} s (measured after tuning): cost "
                  f"{cost.ratio:.2f}x; chosen knobs {cost.gain:.2f}x the start")
