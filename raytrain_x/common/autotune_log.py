"""The autotune log: one CSV row per sample, then a row marked `best`."""

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

SCORE_COLUMN = "score_bytes_per_s"
COLUMNS = [
    "sample", "kind", "engine_step", "wall_time_s", "fusion_threshold_bytes",
    "fusion_threshold_mb", "fusion_threshold_log2", "cycle_time_ms", "cache_capacity",
    "hierarchical_allreduce", "hierarchical_allgather", SCORE_COLUMN, "warmup", "best",
]


@dataclass
class Sample:
    """One measured setting."""

    index: int
    knobs: Knobs
    score: float  # bytes allreduced + allgathered per second
    engine_step: int
    wall_time_s: float
    warmup: bool = False


# Row kinds: "warmup" (discarded), "sample" (a search sample), "confirm" (a candidate
# measured again before the decision), "best" (the final choice, its mean score).
SCORED_KINDS = ("sample", "confirm")


def row_of(sample: Sample, kind: str, best: bool) -> dict[str, Any]:
    k = sample.knobs
    return {
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
        SCORE_COLUMN: round(sample.score, 1),
        "warmup": int(sample.warmup),
        "best": int(best),
    }


class AutotuneLog:
    """Appends rows as samples complete, so a job that ends early keeps what it measured."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w", newline="") as f:
            csv.DictWriter(f, COLUMNS).writeheader()

    def append(self, sample: Sample, kind: str, best: bool = False) -> None:
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, COLUMNS).writerow(row_of(sample, kind, best))

    def finish(self, best: Sample) -> Path:
        """Writes the `best` row and `<log>.knobs.json`; returns the knobs file path."""
        self.append(best, "best", best=True)
        knobs_path = self.path.with_suffix(".knobs.json")
        knobs_path.write_text(json.dumps({"knobs": best.knobs.to_dict(),
                                          SCORE_COLUMN: best.score}, indent=2))
        return knobs_path


def read_rows(path: str | os.PathLike) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or set(COLUMNS) - set(rows[0]):
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
