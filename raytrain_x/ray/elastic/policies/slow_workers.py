"""A straggler policy: a worker whose steps hold the others back leaves when the job's
throughput without it is higher than with it."""

from __future__ import annotations

from dataclasses import dataclass

from raytrain_x.common.errors import ConfigError
from raytrain_x.ray.elastic.policies.injected import JobSnapshot, Leave


@dataclass(frozen=True)
class SlowWorkers:
    """Sends away the slowest worker of a synchronous job when the others, without it,
    would train at least `min_gain` times as many samples a second.

    Every worker waits for the slowest at each step, so n workers whose slowest works
    `w_max` a step train n / w_max samples (of one batch each) a second; without the
    slowest, n - 1 / w'_max, `w'_max` the slowest of the others. The worker leaves when that
    ratio reaches `min_gain` (one of 3 workers twice as slow: 1.33; one of 2: 1.0, so
    never), once every member has measured `min_steps` steps in the round, and never
    below `min_workers`. Its host takes no new worker for `cooldown_s`: a slow host (a
    throttled chip, a noisy neighbour) would be slow again. One worker leaves per round:
    the next round measures again.

    Args:
        min_gain: the least estimated rise in samples/s that sends a worker away (> 1).
        min_steps: steps every member must have measured in the round first.
        cooldown_s: how long its host takes no new worker.
    """

    min_gain: float = 1.2
    min_steps: int = 10
    cooldown_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.min_gain > 1.0:
            raise ConfigError(f"SlowWorkers(min_gain=...) must be > 1 (the rise in samples/s "
                              f"that sends a worker away), got {self.min_gain!r}")
        if isinstance(self.min_steps, bool) or not isinstance(self.min_steps, int) \
                or self.min_steps < 1:
            raise ConfigError(f"SlowWorkers(min_steps=...) must be an int >= 1, got "
                              f"{self.min_steps!r}")
        if not self.cooldown_s >= 0:
            raise ConfigError(f"SlowWorkers(cooldown_s=...) must be >= 0, got "
                              f"{self.cooldown_s!r}")

    def gain(self, job: JobSnapshot) -> float:
        """The estimated samples/s without the slowest member over with it (0: not
        measured yet, or too few members to tell)."""
        members = job.members
        if len(members) < 2 or any(m.work_steps < self.min_steps or m.work_s <= 0
                                   for m in members):
            return 0.0
        ordered = sorted(members, key=lambda m: m.work_s)
        slowest, next_slowest = ordered[-1].work_s, ordered[-2].work_s
        n = len(members)
        return ((n - 1) / next_slowest) / (n / slowest)

    def decide(self, job: JobSnapshot) -> list[Leave]:
        if len(job.members) - 1 < max(1, job.min_workers):
            return []
        gain = self.gain(job)
        if gain < self.min_gain:
            return []
        slowest = max(job.members, key=lambda m: m.work_s)
        others = sorted(m.work_s for m in job.members if m is not slowest)
        typical = others[len(others) // 2]
        return [Leave(slowest.worker_id,
                      f"slow: its work per step ({slowest.work_s * 1000:.0f} ms) is "
                      f"{slowest.work_s / typical:.1f}x its peers' ({typical * 1000:.0f} ms); "
                      f"without it the job trains an estimated {gain:.2f}x the samples/s",
                      self.cooldown_s)]
