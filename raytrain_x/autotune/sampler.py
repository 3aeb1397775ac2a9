"""Measures autotune samples on rank 0's engine and switches the knobs between them.

Runs on the engine thread as a cycle hook. Steps end at the marks `DistributedOptimizer`
(or the user, through `mark_step`) sets; a script that never marks a step falls back to
inferring steps from repeated tensor names. A sample's score is the median, over
`sub_windows` equal sub-windows, of steps per second (samples per second when the batch
size is known) or, without step marks, of bytes allreduced + allgathered per second.

Before the search starts the sampler decides which knobs can matter in this job (the
search spends no sample on the others); after the search it measures the chosen knobs
once more to report what tuning cost.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import logging
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from raytrain_x.common.autotune_config import AutotuneConfig
from raytrain_x.common.autotune_log import AutotuneLog, Sample, TuningCost
from raytrain_x.common.knobs import MB, Knobs
from raytrain_x.common.logs import progress_logger
from raytrain_x.engine.messages import ALLGATHER, ALLREDUCE, Response

log = logging.getLogger("raytrain_x.autotune")

# What the fusion threshold governs on this job's path, as frameworks report it.
BATCHING_FIXED_BUCKETS = "fixed buckets"  # buckets of a size the user fixed


class Advisor(Protocol):
    """What the sampler asks for the next knobs (the controller, in-process or an actor)."""

    def begin(self, searched: list[str]) -> list[str]: ...

    def report(self, score: float) -> dict[str, Any]: ...


def describe(knobs: Knobs) -> str:
    return (f"bucket/fusion {knobs.fusion_threshold_bytes / MB:g} MB, cycle "
            f"{knobs.cycle_time_ms:g} ms, cache {knobs.cache_capacity}, hier ar/ag "
            f"{int(knobs.hierarchical_allreduce)}/{int(knobs.hierarchical_allgather)}")


@dataclasses.dataclass
class JobShape:
    """What the sampler knows of the world when it starts."""

    size: int = 1
    multi_level: bool = False  # more than one host and more than one worker per host


class Phase(str, enum.Enum):
    """Where the sampler is; `AutotuneSampler.phase` names it."""

    WARMUP = "warmup"  # samples measured and discarded (caches, allocators settle)
    SCORING = "scoring"  # measuring a search sample
    CONFIRMING = "confirming"  # measuring a leading candidate again
    ADVISING = "waiting for the advisor"  # a score is with the search; training goes on
    SWITCHING = "switching knobs"  # the next knobs are requested, not yet in effect
    COST = "measuring the cost"  # the knobs are chosen; measuring them for the report
    DONE = "done"


class JobObserver:
    """Which knobs can matter in this job, from what it sends before the search starts."""

    def __init__(self) -> None:
        self.allreduce_names: set[str] = set()
        self.fusable = False  # a cycle had two fusable requests
        self.allgathers = False
        self.batching: set[str] = set()  # what frameworks say the fusion threshold governs

    def observe(self, responses: list[Response]) -> None:
        fusable = 0
        for r in responses:
            if r.meta.kind == ALLREDUCE:
                if len(self.allreduce_names) <= 1 << 20:  # bounded: names may never repeat
                    self.allreduce_names.add(r.name)
                fusable += r.meta.fuse and not r.error
            elif r.meta.kind == ALLGATHER:
                self.allgathers = True
        # fusion can only matter where a cycle has two requests to fuse (a lone metric
        # allreduce now and then is not a batch)
        self.fusable = self.fusable or fusable >= 2

    def relevant(self, knobs: Knobs, shape: JobShape) -> tuple[list[str], dict[str, str]]:
        """(knobs to search, {knob: why it is left out})."""
        out: dict[str, str] = {}
        if not self.fusable:
            out["fusion_threshold_bytes"] = (
                "every allreduce is a bucket of a size the user fixed (bucket_cap_mb)"
                if BATCHING_FIXED_BUCKETS in self.batching else "no fusable allreduce")
        names = len(self.allreduce_names)
        if 0 < names <= knobs.cache_capacity:
            out["cache_capacity"] = (f"all {names} allreduce names fit in {knobs.cache_capacity} "
                                     "entries")
        if not shape.multi_level:
            why = "needs several hosts with several workers each"
            out["hierarchical_allreduce"] = out["hierarchical_allgather"] = why
        elif not self.allgathers:
            out["hierarchical_allgather"] = "no allgather"
        return [n for n in Knobs.specs() if n not in out], out


@dataclasses.dataclass
class ScoreWindow:
    """The sample being measured: its sub-windows' rates and the current sub-window."""

    start: float | None = None  # None until the first step boundary opens a window
    steps: int = 0  # steps in the sample so far
    window_steps: int = 0
    window_bytes: int = 0
    rates: list[float] = dataclasses.field(default_factory=list)
    seen: set[str] = dataclasses.field(default_factory=set)  # names this inferred step

    def reset(self) -> None:
        self.seen.clear()
        self.window_bytes = self.window_steps = self.steps = 0
        self.start = None
        self.rates = []

    def next_window(self, now: float) -> None:
        self.start = now
        self.window_bytes = self.window_steps = 0


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

    def warmup(self, sample: Sample) -> None:
        if self.log:
            self.log.append(sample, "warmup")
        self.emit(f"raytrain-x autotune: warmup sample {sample.index}: {describe(sample.knobs)} "
                  f"-> {self.fmt(sample.score, sample.unit)} (discarded)")

    def searching(self, searched: list[str], left_out: dict[str, str], unit: str) -> None:
        skipped = "; ".join(f"{n}: {why}" for n, why in left_out.items())
        self.emit(f"raytrain-x autotune: searching {', '.join(searched) or 'nothing'}"
                  f"{' (left out: ' + skipped + ')' if skipped else ''}; score in {unit}")

    def sample(self, sample: Sample, kind: str, scored: int, best: float, left: int,
               cut: bool) -> None:
        if self.log:
            self.log.append(sample, kind)
        again = " (a candidate measured again)" if kind == "confirm" else ""
        stopped = " (stopped early: far below the best)" if cut else ""
        unit = sample.unit
        self.emit(f"raytrain-x autotune: sample {scored}/{self.config.bayes_opt_max_samples}"
                  f"{again}: {describe(sample.knobs)} -> {self.fmt(sample.score, unit)}"
                  f"{stopped} (best {self.fmt(best, unit)}, {left} left)")

    def decided(self, best: Sample, samples: int, verdict: str) -> None:
        if self.log:
            knobs_file = self.log.finish(best)
            self.emit(f"raytrain-x autotune: log {self.log.path}, knobs {knobs_file}")
        self.emit(f"raytrain-x autotune: done after {samples} samples; keeping "
                  f"{describe(best.knobs)} ({self.fmt(best.score, best.unit)} mean, {verdict})")

    def cost(self, best: Sample, cost: TuningCost, per_step: float) -> None:
        if self.log:
            self.log.finish_cost(best, cost)
        self.emit(f"raytrain-x autotune: tuning took {cost.tuning_s:.1f} s for "
                  f"{cost.tuning_steps} steps; the same steps at the chosen knobs take "
                  f"{cost.tuning_steps * per_step:.1f} s (measured after tuning): cost "
                  f"{cost.ratio:.2f}x; chosen knobs {cost.gain:.2f}x the start")


class AutotuneSampler:
    """Rank 0's side of autotuning.

    Args:
        config: the autotune settings.
        advisor: answers each score with the next knobs (and says when tuning is done).
        request_knobs: asks the engine to switch every rank's knobs.
        emit: prints a progress line (default: print, flushed).
        shape: the world's size and layout (which dimensions can matter).
        clock: seconds, monotonic (tests pass their own).
        background: ask the advisor on a helper thread while training goes on at the
            current knobs (the search's GP fit takes tens of milliseconds, a remote
            controller a round trip, and the engine thread must not wait for either);
            False answers in place (deterministic, for tests).
    """

    def __init__(self, config: AutotuneConfig, advisor: Advisor,
                 request_knobs: Callable[[Knobs], None],
                 emit: Callable[[str], None] | None = None,
                 shape: JobShape | None = None,
                 clock: Callable[[], float] = time.monotonic, background: bool = True) -> None:
        self.config = config
        self.advisor = advisor
        self.request_knobs = request_knobs
        self.report = SamplerReport(config, emit)
        self.shape = shape or JobShape()
        self.clock = clock
        self.samples: list[Sample] = []
        self.done = False  # the knobs are chosen
        self.finished = False  # ... and measured again for the cost report
        self.best: Sample | None = None
        self.searched: list[str] | None = None  # decided at the first scored sample
        self.left_out: dict[str, str] = {}
        self.cost: TuningCost | None = None
        self.samples_per_step: int | None = None  # batch size x world size, when known
        self.observer = JobObserver()
        self.window = ScoreWindow()
        self._started = clock()
        self._target: Knobs | None = None  # knobs we wait to see in effect
        self._marks: list[float] = []
        self._marks_lock = threading.Lock()
        self._step_mode = False
        self._warmups_left = config.warmup_samples if config.warmup_time_s is None else 0
        self._confirming = False  # the sample being measured re-measures a candidate
        # the cost of tuning: steps and time from the first scored sample to the decision
        self._tuning_start: float | None = None
        self._tuning_steps = 0
        self._background = background
        self._answer: concurrent.futures.Future | None = None  # the advisor's, pending
        self._answered: tuple[Sample, bool] | None = None  # the sample asked about, cut?

    @property
    def phase(self) -> Phase:
        """The sampler's state: warmup, scoring, confirming, waiting for the advisor,
        switching knobs, measuring the cost, done."""
        if self.finished:
            return Phase.DONE
        if self.done:
            return Phase.COST
        if self._answer is not None:
            return Phase.ADVISING
        if self._target is not None:
            return Phase.SWITCHING
        if self._warmups_left or self._in_warmup_time(self.clock()):
            return Phase.WARMUP
        return Phase.CONFIRMING if self._confirming else Phase.SCORING

    @property
    def batching(self) -> set[str]:
        """What the fusion threshold governs on this job's path, as frameworks report it."""
        return self.observer.batching

    # ------------------------------------------------------------------ user thread
    def mark_step(self) -> None:
        """A training step ended (called from the training thread)."""
        now = self.clock()
        with self._marks_lock:
            self._marks.append(now)

    def _take_marks(self) -> list[float]:
        with self._marks_lock:
            marks, self._marks = self._marks, []
        return marks

    @property
    def unit(self) -> str:
        if not self._step_mode:
            return "bytes/s"
        return "samples/s" if self.samples_per_step else "steps/s"

    # ------------------------------------------------------------------ engine hook
    def on_cycle(self, knobs: Knobs, step: int, responses: list[Response]) -> None:
        """Called by the engine after every cycle that completed collectives."""
        if self.finished:  # Phase.DONE
            return
        if self.searched is None:
            self.observer.observe(responses)
        marks = self._take_marks()
        if marks and not self._step_mode:  # explicit step marks replace inferred steps
            self._step_mode = True
            self.window.reset()
        if self._answer is not None:  # Phase.ADVISING: training goes on at these knobs
            self._count_tuning_steps(len(marks))
            if not self._answer.done():
                return
            answer, self._answer = self._answer.result(), None
            self._on_answer(answer, self.clock())
            return
        if self._target is not None:  # Phase.SWITCHING
            self._count_tuning_steps(len(marks))  # steps while the switch lands
            if knobs != self._target:
                return
            self._target = None
            self.window.reset()  # the step in flight ran partly under the old knobs
            marks = []
        if self._step_mode:
            for i, t in enumerate(marks):
                if self._target is not None or self._answer is not None:  # a sample ended
                    self._count_tuning_steps(len(marks) - i)
                    break
                self._on_step_boundary(knobs, step, t)
        else:
            names = [r.name for r in responses]
            if any(n in self.window.seen for n in names):
                self._on_step_boundary(knobs, step, self.clock())
                self.window.seen.clear()
            self.window.seen.update(names)
            self.window.window_bytes += sum(
                r.meta.nbytes_on_wire() for r in responses
                if r.meta.kind in (ALLREDUCE, ALLGATHER) and not r.error)

    def _count_tuning_steps(self, n: int) -> None:
        if self._tuning_start is not None and not self.done:
            self._tuning_steps += n

    def _observe(self, responses: list[Response]) -> None:
        self.observer.observe(responses)

    def _on_step_boundary(self, knobs: Knobs, step: int, now: float) -> None:
        w = self.window
        if w.start is None:  # the first boundary opens the first window
            self._count_tuning_steps(1)
            w.next_window(now)
            return
        if self._in_warmup_time(now):
            w.start = now
            w.window_bytes = 0
            return
        if self._tuning_start is None and not self._warmups_left and not self.done:
            self._tuning_start = w.start  # the first scored sample starts here
        self._count_tuning_steps(1)
        w.steps += 1
        w.window_steps += 1
        if self.done:  # Phase.COST: measuring the chosen knobs for the cost report
            if w.steps >= self._after_steps():
                self._finish_after(now)
            return
        if self.config.sampling_time_s:
            per_window = self.config.sampling_time_s / self.config.sub_windows
            window_full = now - w.start >= per_window
        else:
            per_window = max(1, self.config.steps_per_sample // self.config.sub_windows)
            window_full = w.steps % per_window == 0
        elapsed = max(now - w.start, 1e-9)
        if self._step_mode:
            rate = w.window_steps * (self.samples_per_step or 1) / elapsed
        else:
            rate = w.window_bytes / elapsed
        if window_full:
            w.rates.append(rate)
            w.next_window(now)
        if self._clearly_worse(rate, window_full):
            self._finish_sample(knobs, step, rate, now, cut=True)
            return
        if len(w.rates) >= self.config.sub_windows:
            self._finish_sample(knobs, step, statistics.median(w.rates), now)

    def _in_warmup_time(self, now: float) -> bool:
        return bool(self.config.warmup_time_s and now - self._started < self.config.warmup_time_s)

    def _clearly_worse(self, rate: float, window_full: bool) -> bool:
        """True when a search sample is far below the best so far, so the rest of it would
        only cost training time: below `early_stop_ratio` of the best mean after its first
        sub-window, or below `early_stop_ratio - 0.3` after any step before that (a setting
        several times slower is seen in one step). Leaders being confirmed are never cut."""
        ratio = self.config.early_stop_ratio
        if not ratio or self._confirming or self._warmups_left or self.best is None:
            return False
        if window_full:
            return len(self.window.rates) == 1 and rate < ratio * self.best.score
        return not self.window.rates and self._step_mode and self._severely_worse(rate)

    def _severely_worse(self, rate: float) -> bool:
        """Several times slower than the best so far: one step shows it."""
        ratio = self.config.early_stop_ratio
        return bool(ratio) and self.best is not None and rate < (ratio - 0.3) * self.best.score

    # ------------------------------------------------------------------ samples
    def _finish_sample(self, knobs: Knobs, step: int, score: float, now: float,
                       cut: bool = False) -> None:
        warmup = self._warmups_left > 0
        sample = Sample(len(self.samples), knobs, score, step, now - self._started, warmup,
                        unit=self.unit)
        self.samples.append(sample)
        self.window.rates = []
        self.window.steps = 0
        if warmup:
            self._warmups_left -= 1
            self.report.warmup(sample)
            return
        first = self.searched is None
        if first:
            self.searched, self.left_out = self.relevant_dimensions(knobs)
        self._answered = (sample, cut)
        if self._background:
            self._answer = _in_background(self._ask, score, first)
            if cut and self._severely_worse(score):  # wait at the best knobs, not these
                self.request_knobs(self.best.knobs)
        else:
            self._on_answer(self._ask(score, first), now)

    def _ask(self, score: float, first: bool) -> dict[str, Any]:
        """The advisor's answer to a score (on the helper thread when in the background)."""
        if first:
            relevant = self.searched
            searched = self.advisor.begin(list(relevant))  # the advisor drops fixed knobs
            for name in relevant:
                if name not in searched:
                    self.left_out[name] = "fixed by the user"
            self.searched = searched
        return self.advisor.report(score)

    def _on_answer(self, answer: dict[str, Any], now: float) -> None:
        sample, cut = self._answered
        knobs = sample.knobs
        if sample.index == min(s.index for s in self.samples if not s.warmup):
            self.report.searching(self.searched, self.left_out, self.unit)
        sample.searched = "+".join(self.searched) or "none"
        scored = [s for s in self.samples if not s.warmup]
        best_knobs = Knobs(**answer["best"])
        latest = next((s for s in reversed(scored) if s.knobs == best_knobs), scored[0])
        self.best = dataclasses.replace(latest, score=answer["best_score"])  # mean score
        kind = "confirm" if self._confirming else "sample"
        self._confirming = bool(answer.get("confirming")) and not answer["done"]
        self.report.sample(sample, kind, len(scored), self.best.score, answer["samples_left"],
                           cut)
        nxt = Knobs(**answer["next"])
        if answer["done"]:
            self._decide(scored, now)
        if nxt != knobs:
            self._target = nxt
            self.request_knobs(nxt)
        else:
            self.window.reset()

    def relevant_dimensions(self, knobs: Knobs) -> tuple[list[str], dict[str, str]]:
        """(knobs to search, {knob: why it is left out}) for this job as observed."""
        return self.observer.relevant(knobs, self.shape)

    def _decide(self, scored: list[Sample], now: float) -> None:
        self.done = True
        tuning_s = now - (self._tuning_start if self._tuning_start is not None else now)
        self.cost = TuningCost(tuning_s=tuning_s, tuning_steps=self._tuning_steps,
                               start_score=statistics.mean(
                                   s.score for s in scored if s.knobs == scored[0].knobs),
                               chosen_score=self.best.score)
        if self.best.knobs == scored[0].knobs:
            verdict = "no setting beat the starting knobs beyond the noise floor"
        else:
            verdict = f"{self.cost.gain:.2f}x the start"
        self.report.decided(self.best, len(scored), verdict)

    def _after_steps(self) -> int:
        return max(2 * self.config.steps_per_sample, 4)

    def _finish_after(self, now: float) -> None:
        """The chosen knobs measured after tuning: what the tuning phase cost."""
        self.finished = True
        per_step = (now - self.window.start) / max(self.window.steps, 1)
        self.cost = dataclasses.replace(self.cost, after_step_s=per_step)
        self.report.cost(self.best, self.cost, per_step)


def _in_background(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    """Runs `fn(*args)` on a daemon thread (never holds up interpreter exit)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - re-raised by future.result()
            future.set_exception(exc)

    threading.Thread(target=run, name="raytrain-x-autotune", daemon=True).start()
    return future
