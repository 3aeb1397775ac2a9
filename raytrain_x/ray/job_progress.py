"""The progress line a running job prints every so often (`raytrain-x run`): steps and
their rate, the world size, autotune's phase. Made from the workers' status snapshots
(`RayExecutor.worker_status`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from raytrain_x.common.periodic import Every


def recent_rate(step_seconds: list[float] | None) -> float | None:
    """Steps per second over a snapshot's latest steps (`step_seconds`), for a first
    reading that has no earlier one to count from; None without any."""
    total = sum(step_seconds or ())
    return len(step_seconds) / total if total > 0 else None


def progress_line(before: dict[str, Any] | None, now: list[dict[str, Any]]) -> str:
    """One line from the lowest rank's status now and, for the rates, the same rank's
    status the line before (`before`, None for the first line)."""
    if not now:
        return "raytrain-x: no worker has started training yet"
    lead = now[0]
    parts = [f"{lead['steps']} steps"]
    rate = None
    if before is not None and lead["time"] > before["time"] and lead["steps"] >= before["steps"]:
        rate = (lead["steps"] - before["steps"]) / (lead["time"] - before["time"])
    else:  # the first line: its latest steps'
        rate = recent_rate(lead.get("step_seconds"))
    if rate is not None:
        samples = (f" ({rate * lead['batch_size'] * (lead['size'] or 1):,.0f} samples/s)"
                   if lead.get("batch_size") else "")
        parts.append(f"{rate:.2f} steps/s{samples}")
    if lead["size"] is not None:
        parts.append(f"{lead['size']} workers (round {lead['round']})")
    tune = lead.get("autotune")
    if tune is not None:
        scored = [s for s in tune["samples"] if not s["warmup"]]
        best = (f", best {tune['best_score']:,.1f} {tune['unit']}"
                if tune["best_score"] is not None else "")
        parts.append(f"autotune {tune['phase']} ({len(scored)} samples{best})")
    return "raytrain-x: " + ", ".join(parts)


class ProgressReporter:
    """Emits `progress_line` every `every_s` seconds on a daemon thread until `stop()`.

    Args:
        status: the workers' statuses now, lowest rank first.
        every_s: seconds between lines.
        emit: where each line goes.
    """

    def __init__(self, status: Callable[[], list[dict[str, Any]]], every_s: float,
                 emit: Callable[[str], None]) -> None:
        self.status, self.emit = status, emit
        self._before: dict[str, Any] | None = None
        self._every = Every(every_s, self._line, "raytrain-x-progress")

    def start(self) -> ProgressReporter:
        self._every.start()
        return self

    def stop(self) -> None:
        self._every.stop(timeout_s=5.0)

    def _line(self) -> None:
        try:
            now = self.status()
        except Exception:  # noqa: BLE001 - a progress line is no reason to fail a job
            return
        if self._every.stopped:  # the job ended while its workers were asked
            return
        self.emit(progress_line(self._before, now))
        if now:
            self._before = now[0]
