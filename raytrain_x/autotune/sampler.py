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

from raytrain_x.autotune.observer import JobObserver, JobShape
from raytrain_x.autotune.progress import SamplerReport
from raytrain_x.common.autotune_config import AutotuneConfig
from raytrain_x.common.autotune_log import Sample, TuningCost
from raytrain_x.common.knobs import Knobs
from raytrain_x.engine.messages import ALLGATHER, ALLREDUCE, Response

log = logging.getLogger("raytrain_x.autotune")



class Advisor(Protocol):
    """What the sampler asks for the next knobs (the controller, in-process or an actor)."""

    def begin(self, searched: list[str]) -> list[str]: ...

    def report(self, score: float) -> dict[str, Any]: ...






class Phase(str, enum.Enum):
    """Where the sampler is (`AutotuneSampler.phase`). It measures in WARMUP, SCORING,
    CONFIRMING and COST; after a search sample it waits for the advisor (ADVISING, in the
    background), then for the next knobs to take effect (SWITCHING) before measuring in
    the phase the answer called for; after COST it is DONE."""

    WARMUP = "warmup"  # samples measured and discarded (caches, allocators settle)
    SCORING = "scoring"  # measuring a search sample
    CONFIRMING = "confirming"  # measuring a leading candidate again
    ADVISING = "waiting for the advisor"  # a score is with the search; training goes on
    SWITCHING = "switching knobs"  # the next knobs are requested, not yet in effect
    COST = "measuring the cost"  # the knobs are chosen; measuring them for the report
    DONE = "done"




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
        self.best: Sample | None = None
        self.searched: list[str] | None = None  # decided at the first scored sample
        self.left_out: dict[str, str] = {}
        self.cost: TuningCost | None = None
        self.samples_per_step: int | None = None  # batch size x world size, when known
        self.observer = JobObserver()
        self.window = ScoreWindow()
        self._started = clock()
        self._target: Knobs | None = None  # SWITCHING: the knobs we wait to see in effect
        self._after_switch = Phase.SCORING  # SWITCHING: the phase the new knobs are for
        self._marks: list[float] = []
        self._marks_lock = threading.Lock()
        self._step_mode = False
        self._warmups_left = config.warmup_samples if config.warmup_time_s is None else 0
        self._phase = Phase.WARMUP if self._warmups_left or config.warmup_time_s \
            else Phase.SCORING
        # the cost of tuning: steps and time from the first scored sample to the decision
        self._tuning_start: float | None = None
        self._tuning_steps = 0
        self._background = background
        self._answer: concurrent.futures.Future | None = None  # ADVISING: the answer
        # the sample asked about: (it, whether it was cut short, whether it confirmed)
        self._answered: tuple[Sample, bool, bool] | None = None

    @property
    def phase(self) -> Phase:
        """The sampler's phase: warmup, scoring, confirming, waiting for the advisor,
        switching knobs, measuring the cost, done."""
        return self._phase

    @property
    def done(self) -> bool:
        """The knobs are chosen (they may still be measured for the cost report)."""
        return self.cost is not None

    @property
    def finished(self) -> bool:
        """The knobs are chosen and measured again for the cost report."""
        return self._phase is Phase.DONE

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
        if self._phase is Phase.DONE:
            return
        if self.searched is None:
            self.observer.observe(responses)
        marks = self._take_marks()
        if marks and not self._step_mode:  # explicit step marks replace inferred steps
            self._step_mode = True
            self.window.reset()
        if self._phase is Phase.ADVISING:  # training goes on at these knobs
            self._count_tuning_steps(len(marks))
            if not self._answer.done():
                return
            answer, self._answer = self._answer.result(), None
            self._on_answer(answer, self.clock())
            return
        if self._phase is Phase.SWITCHING:
            self._count_tuning_steps(len(marks))  # steps while the switch lands
            if knobs != self._target:
                return
            self._target, self._phase = None, self._after_switch
            self.window.reset()  # the step in flight ran partly under the old knobs
            marks = []
        if self._step_mode:
            for i, t in enumerate(marks):
                if self._phase in (Phase.ADVISING, Phase.SWITCHING):  # a sample ended
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
        if self._phase is Phase.WARMUP and not self._warmups_left:
            self._phase = Phase.SCORING  # the warmup time is over
        if self._tuning_start is None and not self._warmups_left and not self.done:
            self._tuning_start = w.start  # the first scored sample starts here
        self._count_tuning_steps(1)
        w.steps += 1
        w.window_steps += 1
        if self._phase is Phase.COST:  # measuring the chosen knobs for the cost report
            if w.steps >= self._after_steps():
                self._finish_after(now)
            return
        if self.config.sampling_time_s:
            per_window = self.config.sampling_time_s / self.config.rules.sub_windows
            window_full = now - w.start >= per_window
        else:
            per_window = max(1, self.config.steps_per_sample // self.config.rules.sub_windows)
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
        if len(w.rates) >= self.config.rules.sub_windows:
            self._finish_sample(knobs, step, statistics.median(w.rates), now)

    def _in_warmup_time(self, now: float) -> bool:
        return bool(self.config.warmup_time_s and now - self._started < self.config.warmup_time_s)

    def _clearly_worse(self, rate: float, window_full: bool) -> bool:
        """True when a search sample is far below the best so far, so the rest of it would
        only cost training time: below `early_stop_ratio` of the best mean after its first
        sub-window, or below `early_stop_ratio - 0.3` after any step before that (a setting
        several times slower is seen in one step). Leaders being confirmed are never cut."""
        ratio = self.config.rules.early_stop_ratio
        if not ratio or self._phase is not Phase.SCORING or self.best is None:
            return False
        if window_full:
            return len(self.window.rates) == 1 and rate < ratio * self.best.score
        return not self.window.rates and self._step_mode and self._severely_worse(rate)

    def _severely_worse(self, rate: float) -> bool:
        """Several times slower than the best so far: one step shows it."""
        ratio = self.config.rules.early_stop_ratio
        return bool(ratio) and self.best is not None and rate < (ratio - 0.3) * self.best.score

    # ------------------------------------------------------------------ samples
    def _finish_sample(self, knobs: Knobs, step: int, score: float, now: float,
                       cut: bool = False) -> None:
        warmup = self._phase is Phase.WARMUP
        sample = Sample(len(self.samples), knobs, score, step, now - self._started, warmup,
                        unit=self.unit)
        self.samples.append(sample)
        self.window.rates = []
        self.window.steps = 0
        if warmup:
            self._warmups_left -= 1
            if not self._warmups_left:
                self._phase = Phase.SCORING
            self.report.warmup(sample)
            return
        first = self.searched is None
        if first:
            self.searched, self.left_out = self.relevant_dimensions(knobs)
        self._answered = (sample, cut, self._phase is Phase.CONFIRMING)
        if self._background:
            self._answer = _in_background(self._ask, score, first)
            self._phase = Phase.ADVISING
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
        sample, cut, confirmed = self._answered
        knobs = sample.knobs
        if sample.index == min(s.index for s in self.samples if not s.warmup):
            self.report.searching(self.searched, self.left_out, self.unit)
        sample.searched = "+".join(self.searched) or "none"
        scored = [s for s in self.samples if not s.warmup]
        best_knobs = Knobs(**answer["best"])
        latest = next((s for s in reversed(scored) if s.knobs == best_knobs), scored[0])
        self.best = dataclasses.replace(latest, score=answer["best_score"])  # mean score
        self.report.sample(sample, "confirm" if confirmed else "sample", len(scored),
                           self.best.score, answer["samples_left"], cut)
        measuring = Phase.CONFIRMING if answer.get("confirming") else Phase.SCORING
        if answer["done"]:
            self._decide(scored, now)
            measuring = Phase.COST
        nxt = Knobs(**answer["next"])
        if nxt != knobs:
            self._phase, self._target, self._after_switch = Phase.SWITCHING, nxt, measuring
            self.request_knobs(nxt)
        else:
            self._phase = measuring
            self.window.reset()

    def relevant_dimensions(self, knobs: Knobs) -> tuple[list[str], dict[str, str]]:
        """(knobs to search, {knob: why it is left out}) for this job as observed."""
        return self.observer.relevant(knobs, self.shape)

    def _decide(self, scored: list[Sample], now: float) -> None:
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
        self._phase = Phase.DONE
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
