"""The autotune search: one joint space over every free knob, Ray Tune's BayesOptSearch.

`AutotuneController` is plain Python so it can run in-process (a launched script's rank 0)
or as a Ray actor (`raytrain_x.ray.autotune_actor`, started by `RayExecutor`).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

from raytrain_x.common.autotune_config import AutotuneConfig
from raytrain_x.common.extras import import_extra
from raytrain_x.common.knobs import Knobs

log = logging.getLogger("raytrain_x.autotune")

@dataclass
class SearchSpace:
    """The joint space of every knob not fixed by the user.

    Args:
        base: values of the fixed knobs (and the start of the search).
        fixed: knob names held constant (given by flag, env or config file).
    """

    base: Knobs
    fixed: frozenset[str]

    def restricted_to(self, searched: list[str]) -> SearchSpace:
        """The same space with every knob outside `searched` held at its base value."""
        return SearchSpace(self.base, self.fixed | (frozenset(Knobs.specs()) - set(searched)))

    def dimensions(self) -> dict[str, tuple[float, float]]:
        """Each searched knob's coordinate bounds (its `KnobSpec.search` scale)."""
        return {name: (spec.search.lo, spec.search.hi) for name, spec in Knobs.specs().items()
                if spec.search is not None and name not in self.fixed}

    def switches(self) -> list[str]:
        """The on/off knobs being searched."""
        specs = Knobs.specs()
        return [name for name in self.dimensions() if not specs[name].search.base]

    def to_knobs(self, point: dict[str, float]) -> Knobs:
        specs = Knobs.specs()
        return self.base.replace(**{name: specs[name].search.value(float(x))
                                    for name, x in point.items()})

    def to_point(self, knobs: Knobs) -> dict[str, float]:
        """The searcher's coordinates of `knobs` (clipped into the space)."""
        specs = Knobs.specs()
        return {name: specs[name].search.coordinate(getattr(knobs, name))
                for name in self.dimensions()}


class AutotuneController:
    """Proposes knobs, takes each sample's score, decides when tuning is over.

    The first proposal is the starting knobs, so the result is never worse than the start:
    if no candidate beats it by more than `min_improvement`, the start stays. The search
    stops a few samples before `bayes_opt_max_samples` (2 x `confirm_top`, at most a
    quarter of the budget), or earlier on convergence. Then the leaders are confirmed: the
    best `confirm_top` settings by mean score are measured again until each has two
    measurements (re-ranking after each one), and the choice is made among confirmed
    settings and the start, by mean score.
    """

    def __init__(self, config: AutotuneConfig, start: Knobs, fixed: frozenset[str]) -> None:
        self.config = config
        self.space = SearchSpace(start, frozenset(fixed))
        self.start = start
        self.samples: list[tuple[Knobs, float]] = []
        self.current = start
        self._reference: float | None = None
        self._since_best = 0
        self._searcher = None
        self._trial = 0
        self._confirming = False
        # Measured before the searcher proposes anything, and registered with it as the
        # start is: the start with each searched switch flipped (see `begin`).
        self._probes: list[Knobs] = []
        self._rng = random.Random(config.seed)
        self._began = False
        if self.space.dimensions():  # import now (~0.8 s), not inside the tuning phase
            import_extra("ray.tune.search.bayesopt", "tune", "autotune")

    def begin(self, searched: list[str] | None = None) -> list[str]:
        """Starts the search over `searched` (the knobs that can matter in this job, as the
        sampler observed it; every free knob when None). Fixed knobs stay fixed. Returns
        the knobs searched."""
        if self._began:
            return self.free_knobs
        self._began = True
        if searched is not None:
            self.space = self.space.restricted_to(searched)
        dims = self.space.dimensions()
        if dims:
            from ray.tune.search.bayesopt import BayesOptSearch

            # Every result is registered at once (no buffered "random" phase: its
            # suggestions come from a GP that has not seen the buffered results, so they
            # repeat one corner). A milder UCB (kappa 1) than the default 2.576 spends fewer samples
            # on corners: every sample is training time.
            self._searcher = BayesOptSearch(
                space=dict(dims),
                metric="score", mode="max",
                utility_kwargs={"kind": "ucb", "kappa": 1.0, "xi": 0.0},
                random_search_steps=0,
                random_state=self.config.seed, skip_duplicate=False,
                patience=10**6)  # repeats are handled in _next_unmeasured
            self._searcher.optimizer.set_gp_params(alpha=self.config.gaussian_process_noise)
            # A switch (hierarchical allreduce) changes the score by a step, not a slope:
            # the GP cannot tell which side of it the best lies from nearby points, and
            # the searcher has been seen to explore the other dimensions only on one side.
            # The start with each switch flipped is measured first, one sample each.
            self._probes = [self.start.replace(**{name: not getattr(self.start, name)})
                            for name in self.space.switches()]
        return self.free_knobs

    def _trial_id(self) -> str:
        return f"sample{self._trial}"

    @property
    def free_knobs(self) -> list[str]:
        return list(self.space.dimensions())

    @property
    def confirming(self) -> bool:
        """True once the search is over and the leaders are being measured again."""
        return self._confirming

    def _scores(self) -> dict[Knobs, list[float]]:
        """Every measurement of every setting, in first-measured order."""
        scores: dict[Knobs, list[float]] = {}
        for knobs, score in self.samples:
            scores.setdefault(knobs, []).append(score)
        return scores

    def best(self) -> tuple[Knobs, float]:
        """The best setting by mean score, among the confirmed ones (measured twice) and the
        start once any is confirmed. The start wins unless beaten by more than the noise
        floor: `min_improvement`, or the spread seen between repeated measurements of one
        setting when that is wider."""
        if not self.samples:
            return self.start, 0.0
        scores = self._scores()
        means = {k: _mean(v) for k, v in scores.items()}
        confirmed = {k: m for k, m in means.items() if len(scores[k]) > 1 or k == self.start}
        pool = confirmed if len(confirmed) > 1 else means
        knobs, score = max(pool.items(), key=lambda item: item[1])
        if score <= means[self.start] * (1 + max(self.config.rules.min_improvement, self.noise())):
            return self.start, means[self.start]
        return knobs, score

    def noise(self) -> float:
        """Median relative spread, (max - min) / mean, of settings measured more than once:
        what one setting's score moves by between measurements on this machine."""
        spreads = [(max(v) - min(v)) / _mean(v) for v in self._scores().values()
                   if len(v) > 1 and _mean(v) > 0]
        return sorted(spreads)[(len(spreads) - 1) // 2] if spreads else 0.0  # lower median

    def report(self, score: float) -> dict[str, Any]:
        """Records the score of `self.current`; returns the next knobs and whether done."""
        self.begin()
        previous_best = max((s for _, s in self.samples), default=0.0)
        self.samples.append((self.current, score))
        if self._reference is None:
            self._reference = score or 1.0
        if score > previous_best * (1 + self.config.rules.min_improvement):
            self._since_best = 0
        else:
            self._since_best += 1
        budget = self.config.bayes_opt_max_samples
        patience = self.config.rules.convergence_patience
        if not self._confirming:
            self._confirming = (len(self.samples) >= budget - self._reserved()
                                or self._searcher is None
                                or bool(patience and self._since_best >= patience))
            if not self._confirming:
                if len(self.samples) == 1 or self._probed(self.current):
                    # the start and the probes were measured outside the searcher
                    self._searcher.optimizer.register(self.space.to_point(self.current),
                                                      score / self._reference)
                else:
                    self._searcher.on_trial_complete(self._trial_id(),
                                                     {"score": score / self._reference})
                    self._trial += 1
                self.current = self._probes[0] if self._probes else self._next_unmeasured()
        done = False
        if self._confirming:
            again = (self._next_confirmation()
                     if self._searcher is not None and len(self.samples) < budget else None)
            done = again is None
            if again is not None:
                self.current = again
        best, best_score = self.best()
        if done:
            self.current = best
        return {"next": self.current.to_dict(), "done": bool(done), "best": best.to_dict(),
                "best_score": best_score, "confirming": self.confirming,
                "samples_left": max(0, budget - len(self.samples))}

    def _probed(self, knobs: Knobs) -> bool:
        """True (once) when `knobs` is the next probe, now measured."""
        if self._probes and knobs == self._probes[0]:
            self._probes.pop(0)
            return True
        return False

    def _reserved(self) -> int:
        """Samples kept for confirming leaders: 2 x `confirm_top`, at most a quarter of the
        budget."""
        return min(2 * self.config.rules.confirm_top, self.config.bayes_opt_max_samples // 4)

    def _next_confirmation(self) -> Knobs | None:
        """The best-ranked leader still measured only once, or None when the top
        `confirm_top` are all confirmed. When another setting leads, the start is measured
        once more too: its first measurement came right after warmup, and a job that still
        speeds up over its first minutes would make any later setting look better."""
        scores = self._scores()
        top = sorted(scores, key=lambda k: _mean(scores[k]), reverse=True)
        top = top[: self.config.rules.confirm_top]
        for knobs in top:
            if len(scores[knobs]) < 2 and not (knobs == self.start and len(top) == 1):
                return knobs
        if top and top[0] != self.start and len(scores[self.start]) < 2:
            return self.start
        return None

    def _next_unmeasured(self) -> Knobs:
        """Asks the searcher until it proposes knobs not measured yet; a repeat is answered
        from the earlier measurement instead of spending a sample on it."""
        from bayes_opt.util import NotUniqueError

        measured = {k: s for k, s in self.samples}
        for _ in range(10):
            point = self._searcher.suggest(self._trial_id())
            if not isinstance(point, dict):  # the searcher declared itself finished
                break
            knobs = self.space.to_knobs(point)
            if knobs not in measured:
                return knobs
            try:
                self._searcher.on_trial_complete(self._trial_id(),
                                                 {"score": measured[knobs] / self._reference})
            except NotUniqueError:  # the exact point again: the acquisition is stuck
                break
            finally:
                self._trial += 1
        # Explore instead of repeating a measurement.
        for _ in range(100):
            point = {name: self._rng.uniform(lo, hi)
                     for name, (lo, hi) in self.space.dimensions().items()}
            knobs = self.space.to_knobs(point)
            if knobs not in measured:
                return knobs
        return knobs


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
