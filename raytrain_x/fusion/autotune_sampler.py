"""Measures autotune samples on rank 0's engine and switches the knobs between them.

Runs on the engine thread as a cycle hook. A training step ends when a tensor name that
already completed since the last step boundary completes again. A sample's score is the
median, over `sub_windows` equal sub-windows, of (bytes allreduced + allgathered) / second.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

from raytrain_x.common.autotune_config import AutotuneConfig
from raytrain_x.common.autotune_log import AutotuneLog, Sample
from raytrain_x.common.knobs import MB, Knobs
from raytrain_x.fusion.messages import ALLGATHER, ALLREDUCE, Response

log = logging.getLogger("raytrain_x.autotune")


class Advisor(Protocol):
    """What the sampler asks for the next knobs (the controller, in-process or an actor)."""

    def report(self, score: float) -> dict[str, Any]: ...


def describe(knobs: Knobs) -> str:
    return (f"fusion {knobs.fusion_threshold_bytes / MB:g} MB, cycle {knobs.cycle_time_ms:g} ms, "
            f"cache {knobs.cache_capacity}, hier ar/ag "
            f"{int(knobs.hierarchical_allreduce)}/{int(knobs.hierarchical_allgather)}")


class AutotuneSampler:
    """Rank 0's side of autotuning.

    Args:
        config: the autotune settings.
        advisor: answers each score with the next knobs (and says when tuning is done).
        request_knobs: asks the engine to switch every rank's knobs.
        emit: prints a progress line (default: print, flushed).
    """

    def __init__(self, config: AutotuneConfig, advisor: Advisor,
                 request_knobs: Callable[[Knobs], None],
                 emit: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.advisor = advisor
        self.request_knobs = request_knobs
        self.emit = emit or (lambda line: print(line, flush=True))
        self.log = AutotuneLog(config.log_file) if config.log_file else None
        self.samples: list[Sample] = []
        self.done = False
        self.best: Sample | None = None
        self._started = time.monotonic()
        self._target: Knobs | None = None  # knobs we wait to see in effect
        self._seen: set[str] = set()
        self._steps = 0
        self._window_bytes = 0
        self._window_start: float | None = None
        self._rates: list[float] = []
        self._sample_start: float | None = None
        self._warmups_left = config.warmup_samples if config.warmup_time_s is None else 0
        self._confirming = False  # the sample being measured re-measures a candidate

    # ------------------------------------------------------------------ engine hook
    def on_cycle(self, knobs: Knobs, step: int, responses: list[Response]) -> None:
        """Called by the engine after every cycle that completed collectives."""
        if self.done:
            return
        if self._target is not None:
            if knobs != self._target:
                return
            self._target = None
            self._reset_window()  # the step in flight ran partly under the old knobs
        nbytes = sum(r.meta.nbytes_on_wire() for r in responses
                     if r.meta.kind in (ALLREDUCE, ALLGATHER) and not r.error)
        names = [r.name for r in responses]
        if any(n in self._seen for n in names):
            self._on_step_boundary(knobs, step)
            self._seen.clear()
        self._seen.update(names)
        self._window_bytes += nbytes

    def _reset_window(self) -> None:
        self._seen.clear()
        self._window_bytes = 0
        self._window_start = None
        self._sample_start = None
        self._steps = 0
        self._rates = []

    def _on_step_boundary(self, knobs: Knobs, step: int) -> None:
        now = time.monotonic()
        if self._window_start is None:  # the first boundary opens the first window
            self._window_start = self._sample_start = now
            self._window_bytes = 0
            return
        if self.config.warmup_time_s and now - self._started < self.config.warmup_time_s:
            self._window_start = self._sample_start = now
            self._window_bytes = 0
            return
        self._steps += 1
        if self.config.sampling_time_s:
            per_window = self.config.sampling_time_s / self.config.sub_windows
            window_full = now - self._window_start >= per_window
        else:
            per_window = max(1, self.config.steps_per_sample // self.config.sub_windows)
            window_full = self._steps % per_window == 0
        if window_full:
            self._rates.append(self._window_bytes / max(now - self._window_start, 1e-9))
            self._window_start = now
            self._window_bytes = 0
        if len(self._rates) >= self.config.sub_windows:
            self._finish_sample(knobs, step, statistics.median(self._rates))

    # ------------------------------------------------------------------ samples
    def _finish_sample(self, knobs: Knobs, step: int, score: float) -> None:
        warmup = self._warmups_left > 0
        sample = Sample(len(self.samples), knobs, score, step,
                        time.monotonic() - self._started, warmup)
        self.samples.append(sample)
        self._rates = []
        self._steps = 0
        if warmup:
            self._warmups_left -= 1
            if self.log:
                self.log.append(sample, "warmup")
            self.emit(f"raytrain-x autotune: warmup sample {sample.index}: {describe(knobs)} -> "
                      f"{score / 1e6:.1f} MB/s (discarded)")
            return
        answer = self.advisor.report(score)
        scored = [s for s in self.samples if not s.warmup]
        best_knobs = Knobs(**answer["best"])
        latest = next((s for s in reversed(scored) if s.knobs == best_knobs), scored[0])
        self.best = dataclasses.replace(latest, score=answer["best_score"])  # mean score
        kind = "confirm" if self._confirming else "sample"
        self._confirming = bool(answer.get("confirming")) and not answer["done"]
        if self.log:
            self.log.append(sample, kind)
        again = " (a candidate measured again)" if kind == "confirm" else ""
        self.emit(f"raytrain-x autotune: sample {len(scored)}/{self.config.bayes_opt_max_samples}"
                  f"{again}: {describe(knobs)} -> {score / 1e6:.1f} MB/s (best "
                  f"{self.best.score / 1e6:.1f} MB/s, {answer['samples_left']} left)")
        nxt = Knobs(**answer["next"])
        if answer["done"]:
            self.done = True
            if self.log:
                knobs_file = self.log.finish(self.best)
                self.emit(f"raytrain-x autotune: log {self.log.path}, knobs {knobs_file}")
            start = [s.score for s in scored if s.knobs == scored[0].knobs]
            if self.best.knobs == scored[0].knobs:
                verdict = "no setting beat the starting knobs beyond the noise floor"
            else:
                ratio = self.best.score / max(sum(start) / len(start), 1e-9)
                verdict = f"{ratio:.2f}x the start"
            self.emit(f"raytrain-x autotune: done after {len(scored)} samples; keeping "
                      f"{describe(self.best.knobs)} ({self.best.score / 1e6:.1f} MB/s mean, "
                      f"{verdict})")
        if nxt != knobs:
            self._target = nxt
            self.request_knobs(nxt)
        else:
            self._reset_window()
