"""Hosts that failed, kept out of the job for a cooldown that grows with each failure."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field


def cooldown_seconds(failures: int, cooldown_range: tuple[float, float],
                     jitter: float = 0.0) -> float:
    """Cooldown after the `failures`-th failure: lo * 2^(n-1) plus `jitter` (0..lo), capped
    at hi. The first failure waits lo (plus jitter)."""
    lo, hi = cooldown_range
    return min(lo * 2 ** (failures - 1) + jitter, hi)


@dataclass
class Blacklist:
    """Failed hosts. Without a cooldown range a host stays out for good.

    Args:
        cooldown_range: (lo, hi) seconds, or None.
        clock: time source (tests pass a fake one).
        rng: jitter source.
    """

    cooldown_range: tuple[float, float] | None = None
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)
    failures: dict[str, int] = field(default_factory=dict)
    until: dict[str, float] = field(default_factory=dict)

    def record_failure(self, host: str) -> float:
        """Blacklists `host`; returns how long it stays out (inf without a cooldown)."""
        n = self.failures.get(host, 0) + 1
        self.failures[host] = n
        if self.cooldown_range is None:
            self.until[host] = float("inf")
            return float("inf")
        wait = cooldown_seconds(n, self.cooldown_range,
                                self.rng.uniform(0, self.cooldown_range[0]))
        self.until[host] = self.clock() + wait
        return wait

    def rest(self, host: str, seconds: float) -> None:
        """Keeps `host` out for `seconds` (a driver policy sent a worker there away), not
        counted as a failure; a longer stay it has already is kept."""
        self.until[host] = max(self.until.get(host, float("-inf")), self.clock() + seconds)

    def is_blacklisted(self, host: str) -> bool:
        return self.clock() < self.until.get(host, float("-inf"))

    def blacklisted(self) -> list[str]:
        return sorted(h for h in self.until if self.is_blacklisted(h))
