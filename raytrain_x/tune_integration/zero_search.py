"""DeepSpeed's fast mode for `zero_stage` and `micro_batch_size`, as a Ray Tune searcher.

DeepSpeed's autotuner tries the ZeRO stages in order; within a stage it raises the
micro-batch size until the memory runs out or the throughput stops rising, and a stage
that does not beat the stage before ends the search. Here each stage after the first
starts at the best size so far (it keeps less per rank, so that size should fit); where it
does not, the stage steps down until a size fits. `FastMode` is that plan as pure
logic (each next experiment follows from the results so far); `FastModeSearcher` puts it
behind Tune's `Searcher`, so that `autotune_experiments(..., search="zero")` runs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ray.tune.search import Searcher

from raytrain_x.common.errors import ConfigError
from raytrain_x.tune_integration.trainable import PEAK_MEMORY, over_memory


@dataclass
class Trial:
    config: dict[str, int]
    score: float | None = None
    peak_mb: float | None = None
    verdict: str = ""


@dataclass
class FastMode:
    """The next `{zero_stage, micro_batch_size}` to try, from the results so far.

    Args:
        stages: the stages to try, in order.
        micro_batches: the micro-batch sizes to try, in increasing order.
        max_memory_mb: an experiment whose peak memory exceeds it counts as failed.
        mode: `max` (a throughput) or `min` (a time).
    """

    stages: list[int]
    micro_batches: list[int]
    max_memory_mb: float | None = None
    mode: str = "max"
    trials: list[Trial] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.stages or not self.micro_batches:
            raise ConfigError("the zero search needs zero_stage and micro_batch_size lists")
        self.micro_batches = sorted(self.micro_batches)
        self._stage = 0  # index into stages
        self._mbs = 0  # index into micro_batches
        self._limit = len(self.micro_batches)  # this stage's first size that did not fit
        self._stage_best: dict[int, Trial] = {}
        self.finished = False

    def _better(self, a: float, b: float | None) -> bool:
        return b is None or (a > b if self.mode == "max" else a < b)

    def next(self) -> dict[str, int] | None:
        """The next configuration, or None when the search is over."""
        if self.finished:
            return None
        return {"zero_stage": self.stages[self._stage],
                "micro_batch_size": self.micro_batches[self._mbs]}

    def record(self, config: dict[str, int], score: float | None,
               peak_mb: float | None) -> Trial:
        """The result of `config` (score None: it failed); moves the plan on."""
        trial = Trial(dict(config), score, peak_mb)
        self.trials.append(trial)
        stage = config["zero_stage"]
        best = self._stage_best.get(stage)
        over = over_memory(peak_mb, self.max_memory_mb)
        if score is None or over:
            trial.score = None
            trial.verdict = over or "failed"
            self._limit = self._mbs
            if best is None and self._mbs > 0:  # the stage's first size did not fit: smaller
                self._mbs -= 1
                return trial
        elif not self._better(score, best.score if best else None):
            trial.verdict = "no faster than a smaller micro-batch: the stage ends here"
        else:
            self._stage_best[stage] = trial
            trial.verdict = "best of its stage so far"
            if self._mbs + 1 < self._limit and not self._tried(stage, self._mbs + 1):
                self._mbs += 1
                return trial
        self._end_stage(stage)
        return trial

    def _tried(self, stage: int, index: int) -> bool:
        size = self.micro_batches[index]
        return any(t.config == {"zero_stage": stage, "micro_batch_size": size}
                   for t in self.trials)

    def _end_stage(self, stage: int) -> None:
        mine = self._stage_best.get(stage)
        before = [self._stage_best[s] for s in self.stages[:self._stage]
                  if s in self._stage_best]
        best_before = None
        for t in before:
            if self._better(t.score, best_before.score if best_before else None):
                best_before = t
        beaten = best_before is not None and (
            mine is None or not self._better(mine.score, best_before.score))
        if beaten or self._stage + 1 >= len(self.stages):
            self.finished = True
            return
        self._stage += 1
        self._limit = len(self.micro_batches)
        # the next stage keeps less per rank: start from the best micro-batch so far (this
        # stage's, which beat those before, or theirs when this one had none)
        leader = mine or best_before
        self._mbs = self.micro_batches.index(leader.config["micro_batch_size"]) if leader \
            else 0


class FastModeSearcher(Searcher):
    """Tune's side of `FastMode`: one configuration at a time, scored by the mean of the
    reports from `start_step` on, its peak memory the largest reported."""

    def __init__(self, plan: FastMode, metric: str, mode: str, start_step: int,
                 max_experiments: int) -> None:
        super().__init__(metric=metric, mode=mode)
        self.plan = plan
        self.start_step = start_step
        self.max_experiments = max_experiments
        self._configs: dict[str, dict[str, int]] = {}
        self._values: dict[str, list[float]] = {}
        self._peaks: dict[str, float] = {}

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        config = self.plan.next()
        if config is None or len(self.plan.trials) >= self.max_experiments:
            return Searcher.FINISHED
        self._configs[trial_id] = config
        return dict(config)

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        value = result.get(self.metric)
        if isinstance(value, (int, float)) and not math.isnan(value):
            self._values.setdefault(trial_id, []).append(float(value))
        peak = result.get(PEAK_MEMORY)
        if isinstance(peak, (int, float)):
            self._peaks[trial_id] = max(self._peaks.get(trial_id, 0.0), float(peak))

    def on_trial_complete(self, trial_id: str, result: dict | None = None,
                          error: bool = False) -> None:
        config = self._configs.pop(trial_id, None)
        if config is None:
            return
        values = self._values.pop(trial_id, [])[self.start_step:]
        score = None if error or not values else sum(values) / len(values)
        self.plan.record(config, score, self._peaks.pop(trial_id, None))
