"""The autotune log: one CSV row per sample, a row marked `best`, then a row marked `after`
(the chosen knobs measured once more, with what tuning cost)."""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_x.common.errors import ConfigError
from raytrain_x.common.knobs import MB, Knobs

SCORE_COLUMN = "score"
KNOB_COLUMNS = ["fusion_threshold_bytes", "cycle_time_ms", "cache_capacity",
                "hierarchical_allreduce", "hierarchical_allgather"]
COLUMNS = [
    "sample", "kind", "engine_step", "wall_time_s", "fusion_threshold_bytes",
    "fusion_threshold_mb", "fusion_threshold_log2", "cycle_time_ms", "cache_capacity",
    "hierarchical_allreduce", "hierarchical_allgather", SCORE_COLUMN, "unit", "searched",
    "warmup", "best", "tuning_s", "tuning_steps", "cost", "gain",
]


@dataclass
class Sample:
    """One measured setting.

    Attributes:
        score: steps/s or samples/s between step marks; bytes/s for scripts without them.
        unit: the score's unit ("steps/s", "samples/s" or "bytes/s").
        searched: the knobs the search moved, joined with "+" (empty before it began).
    """

    index: int
    knobs: Knobs
    score: float
    engine_step: int
    wall_time_s: float
    warmup: bool = False
    unit: str = "bytes/s"
    searched: str = ""


@dataclass(frozen=True)
class TuningCost:
    """What tuning cost: the tuning phase's wall time against the same steps at the chosen
    knobs (their time per step measured after tuning)."""

    tuning_s: float
    tuning_steps: int
    start_score: float
    chosen_score: float
    after_step_s: float | None = None

    @property
    def ratio(self) -> float:
        """Tuning-phase time / the same steps at the chosen knobs (1.0 = free)."""
        if not self.after_step_s or not self.tuning_steps:
            return float("nan")
        return self.tuning_s / (self.tuning_steps * self.after_step_s)

    @property
    def gain(self) -> float:
        """The chosen knobs' mean score over the start's."""
        return self.chosen_score / self.start_score if self.start_score else float("nan")


# Row kinds: "warmup" (discarded), "sample" (a search sample), "confirm" (a candidate
# measured again before the decision), "best" (the final choice, its mean score), "after"
# (the chosen knobs measured after tuning; carries the cost columns).
SCORED_KINDS = ("sample", "confirm")


def row_of(sample: Sample, kind: str, best: bool,
           cost: TuningCost | None = None) -> dict[str, Any]:
    k = sample.knobs
    row = {
        "sample": sample.index if kind != "best" else "best",
        "kind": kind,
        "engine_step": sample.engine_step,
        "wall_time_s": round(sample.wall_time_s, 3),
        "fusion_threshold_bytes": k.fusion_threshold_bytes,
        "fusion_threshold_mb": round(k.fusion_threshold_bytes / MB, 4),
        "fusion_threshold_log2": (round(math.log2(k.fusion_threshold_bytes), 3)
                                  if k.fusion_threshold_bytes else ""),
        "cycle_time_ms": round(k.cycle_time_ms, 4),
        "cache_capacity": k.cache_capacity,
        "hierarchical_allreduce": int(k.hierarchical_allreduce),
        "hierarchical_allgather": int(k.hierarchical_allgather),
        SCORE_COLUMN: round(sample.score, 4),
        "unit": sample.unit,
        "searched": sample.searched,
        "warmup": int(sample.warmup),
        "best": int(best),
    }
    if cost is not None:
        row.update(tuning_s=round(cost.tuning_s, 3), tuning_steps=cost.tuning_steps,
                   cost=round(cost.ratio, 4), gain=round(cost.gain, 4))
    return row


class AutotuneLog:
    """Appends rows as samples complete, so a job that ends early keeps what it measured."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w", newline="") as f:
            csv.DictWriter(f, COLUMNS).writeheader()

    def append(self, sample: Sample, kind: str, best: bool = False,
               cost: TuningCost | None = None) -> None:
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, COLUMNS).writerow(row_of(sample, kind, best, cost))

    def finish(self, best: Sample) -> Path:
        """Writes the `best` row and `<log>.knobs.json`; returns the knobs file path."""
        self.append(best, "best", best=True)
        knobs_path = self.path.with_suffix(".knobs.json")
        knobs_path.write_text(json.dumps({"knobs": best.knobs.to_dict(),
                                          SCORE_COLUMN: best.score, "unit": best.unit},
                                         indent=2))
        return knobs_path

    def finish_cost(self, best: Sample, cost: TuningCost) -> None:
        """Writes the `after` row: the chosen knobs' time per step after tuning and the
        cost of the tuning phase."""
        per_second = 1.0 / cost.after_step_s if cost.after_step_s else 0.0
        after = Sample(best.index, best.knobs, per_second, best.engine_step, best.wall_time_s,
                       unit="steps/s", searched=best.searched)
        self.append(after, "after", cost=cost)


def read_rows(path: str | os.PathLike) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or {"kind", *KNOB_COLUMNS} - set(rows[0]):
        raise ConfigError(f"{str(path)!r} is not a raytrain-x autotune log (columns {COLUMNS})")
    return rows


def knobs_of_row(row: dict[str, str]) -> Knobs:
    return Knobs(
        fusion_threshold_bytes=int(float(row["fusion_threshold_bytes"])),
        cycle_time_ms=float(row["cycle_time_ms"]),
        cache_capacity=int(float(row["cache_capacity"])),
        hierarchical_allreduce=bool(int(row["hierarchical_allreduce"])),
        hierarchical_allgather=bool(int(row["hierarchical_allgather"])),
    )


def load_best_knobs(path: str | os.PathLike) -> Knobs:
    """Best knobs from a log CSV (its `best` row, else its best scored row) or a knobs JSON."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"autotune resume file {str(p)!r} does not exist")
    if p.suffix == ".json":
        data = json.loads(p.read_text())
        return Knobs(**data.get("knobs", data))
    rows = read_rows(p)
    best = [r for r in rows if r["kind"] == "best"]
    if best:
        return knobs_of_row(best[-1])
    scored = [r for r in rows if r["kind"] in SCORED_KINDS]
    if not scored:
        raise ConfigError(f"autotune log {str(p)!r} has no scored samples to resume from")
    return knobs_of_row(max(scored, key=lambda r: float(r[SCORE_COLUMN])))
