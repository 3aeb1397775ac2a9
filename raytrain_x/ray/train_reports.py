"""The reports of an elastic trainer run: what `ray.train.report` recorded, in order, kept
by one Ray actor on the driver's node and written to storage after each report.

A report is recorded once every rank has uploaded its part of the checkpoint (Ray Train's
layout: `{storage_path}/{name}/checkpoint_<time>/`, every rank's files in one folder). The
record keeps rank 0's metrics (`Result.metrics`), every rank's, the checkpoint's folder and
where each Ray Data shard stood at the report, so a run that lost every worker, or is run
again under the same name, goes on from the latest checkpoint with its data where it was.
`CheckpointConfig(num_to_keep, checkpoint_score_attribute, checkpoint_score_order)` prunes
as Ray Train does; the latest checkpoint is always kept (it is the one to resume from).
"""

from __future__ import annotations

import json
import time
from typing import Any

import ray

from raytrain_x.elastic.checkpoints import open_storage
from raytrain_x.ray.placement import stable_node_strategy

__all__ = ["MANIFEST", "RunReports", "kept_names", "start_reports", "storage_uri"]
MANIFEST = "raytrain_x_reports.json"


def storage_uri(storage_path: str, relative: str) -> str:
    """`relative` under `storage_path` as a path or URI Ray's `Checkpoint` opens (a URI's
    query, such as an S3 endpoint, stays at its end)."""
    base, _, query = storage_path.partition("?")
    return f"{base.rstrip('/')}/{relative}" + (f"?{query}" if query else "")


def kept_names(records: list[dict[str, Any]], num_to_keep: int | None,
               score: str | None, order: str) -> list[str]:
    """The checkpoints a `CheckpointConfig` keeps, in report order: the `num_to_keep` best
    by `score` (the latest ones without a score), and always the latest."""
    with_checkpoint = [r for r in records if r.get("checkpoint")]
    if not with_checkpoint or num_to_keep is None:
        return [r["checkpoint"] for r in with_checkpoint]
    if score is None:
        best = with_checkpoint[-num_to_keep:]
    else:
        scored = [r for r in with_checkpoint if score in r["metrics"]]
        best = sorted(scored, key=lambda r: r["metrics"][score],
                      reverse=order == "max")[:num_to_keep]
    keep = {r["checkpoint"] for r in best} | {with_checkpoint[-1]["checkpoint"]}
    return [r["checkpoint"] for r in with_checkpoint if r["checkpoint"] in keep]


class RunReports:
    """The run's report ledger (a Ray actor: `start_reports`).

    Args:
        storage_path: `RunConfig.storage_path`.
        name: `RunConfig.name`: the run's folder under it.
        num_to_keep, score, order: the run's `CheckpointConfig`.
    """

    def __init__(self, storage_path: str, name: str, num_to_keep: int | None,
                 score: str | None, order: str) -> None:
        self._storage = open_storage(storage_path)
        self._name = name
        self._keep = (num_to_keep, score, order)
        data = self._storage.read(f"{name}/{MANIFEST}")
        self._records: list[dict[str, Any]] = json.loads(data)["reports"] if data else []
        self.resumed = bool(self._records)

    def record(self, checkpoint: str | None, metrics: list[dict[str, Any]],
               positions: dict[str, dict[str, int]]) -> int:
        """Records a report (`checkpoint`: its folder's name, uploaded by every rank) and
        writes the ledger; returns its index."""
        self._records.append({"index": len(self._records), "time": time.time(),
                              "checkpoint": checkpoint, "metrics": metrics[0],
                              "all_metrics": metrics, "positions": positions})
        kept = set(kept_names(self._records, *self._keep))
        for record in self._records:
            if record["checkpoint"] and record["checkpoint"] not in kept:
                self._storage.delete(f"{self._name}/{record['checkpoint']}")
                record["checkpoint"], record["pruned"] = None, record["checkpoint"]
        self._storage.publish(f"{self._name}/{MANIFEST}",
                              json.dumps({"reports": self._records}).encode())
        return len(self._records) - 1

    def latest(self) -> dict[str, Any] | None:
        """The latest report with a checkpoint (None: none yet)."""
        return next((r for r in reversed(self._records) if r["checkpoint"]), None)

    def since(self, index: int) -> list[dict[str, Any]]:
        """The reports from `index` on."""
        return self._records[index:]

    def was_resumed(self) -> bool:
        """Whether the run's folder held reports when the ledger started (a run again)."""
        return self.resumed


def start_reports(storage_path: str, name: str, checkpoint_config: Any) -> Any:
    """The ledger actor of a run, on the driver's node."""
    actor = ray.remote(num_cpus=0)(RunReports)
    return actor.options(scheduling_strategy=stable_node_strategy()).remote(
        storage_path, name, checkpoint_config.num_to_keep,
        checkpoint_config.checkpoint_score_attribute,
        checkpoint_config.checkpoint_score_order)
