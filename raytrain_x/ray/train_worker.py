"""Ray Train's worker API inside the elastic trainer's loop: `ray.train.report`,
`get_checkpoint`, `get_all_reported_checkpoints`, `get_context`, `get_dataset_shard` and
`ray.train.collective`, answered by raytrain-x's elastic world rather than Ray Train's
controller (installed through Ray Train's `TrainFnUtils` hook, `internals.py`).

`get_context()` answers for the world as it is now (after every resize); `report` is a
collective over the current world, as in Ray Train: every rank calls it, each uploads its
checkpoint's files into the one folder, and rank 0 records the report once all have.
"""

from __future__ import annotations

import datetime
import shutil
from dataclasses import dataclass
from typing import Any

import ray
from ray.train import Checkpoint
from ray.train.v2.api.context import TrainContext
from ray.train.v2.api.reported_checkpoint import ReportedCheckpoint, ReportedCheckpointStatus

from raytrain_x.common.errors import ConfigError
from raytrain_x.core import runtime
from raytrain_x.core.collectives import barrier
from raytrain_x.core.objects import allgather_object, broadcast_object
from raytrain_x.elastic.checkpoints import open_storage
from raytrain_x.ray import internals
from raytrain_x.ray.data_shard import ElasticDataShard
from raytrain_x.ray.train_reports import storage_uri

__all__ = ["ElasticTrainContext", "RunInfo", "install"]


@dataclass(frozen=True)
class RunInfo:
    """What a worker knows of its run."""

    name: str  # RunConfig.name
    storage_path: str  # RunConfig.storage_path
    reports: Any  # the RunReports actor
    feeds: dict[str, Any]  # dataset name -> its DataFeed actor (the split datasets)
    whole: dict[str, Any]  # dataset name -> the dataset every rank reads whole
    resume: dict[str, Any] | None  # the report the run goes on from (None: its start)

    def checkpoint(self, folder: str) -> Checkpoint:
        return Checkpoint(storage_uri(self.storage_path, f"{self.name}/{folder}"))


class ElasticTrainContext(TrainContext):
    """`ray.train.get_context()` in the elastic trainer: the current world's ranks."""

    def __init__(self, run: RunInfo) -> None:
        self._run = run

    def get_experiment_name(self) -> str:
        return self._run.name

    def get_world_size(self) -> int:
        return runtime.size()

    def get_world_rank(self) -> int:
        return runtime.rank()

    def get_local_rank(self) -> int:
        return runtime.local_rank()

    def get_local_world_size(self) -> int:
        return runtime.local_size()

    def get_node_rank(self) -> int:
        return runtime.cross_rank()

    def get_storage(self) -> Any:
        """The run's storage path (Ray Train returns its `StorageContext`; the elastic
        trainer writes through raytrain-x's storage instead)."""
        return self._run.storage_path


class ElasticTrainFnUtils(internals.train_fn_utils_base()):  # type: ignore[misc]
    """What `ray.train`'s worker functions call in an elastic trainer's worker."""

    def __init__(self, run: RunInfo) -> None:
        self._run = run
        self._context = ElasticTrainContext(run)
        self._shards: dict[str, Any] = {}
        self._storage: Any = None

    # ------------------------------------------------------------ reports
    def report(self, metrics: dict[str, Any], checkpoint: Checkpoint | None = None,
               checkpoint_dir_name: str | None = None, checkpoint_upload_mode: Any = None,
               delete_local_checkpoint_after_upload: bool | None = None,
               checkpoint_upload_fn: Any = None, validation: Any = False) -> None:
        if validation:
            raise ConfigError("ray.train.report(validation=...) is not supported by the "
                              "elastic trainer: validate in the loop and report the metrics")
        if not isinstance(metrics, dict):
            raise ConfigError(f"ray.train.report needs a dict of metrics, got "
                              f"{type(metrics).__name__}")
        folder = None
        if runtime.rank() == 0:
            folder = checkpoint_dir_name or \
                f"checkpoint_{datetime.datetime.now():%Y-%m-%d_%H-%M-%S.%f}"
        folder = broadcast_object(folder, 0, name="train.report.folder")
        if checkpoint is not None:
            if checkpoint_upload_fn is not None:
                checkpoint_upload_fn(checkpoint, storage_uri(self._run.storage_path,
                                                             f"{self._run.name}/{folder}"))
            else:
                self._open_storage().upload(checkpoint.path, f"{self._run.name}/{folder}")
            if delete_local_checkpoint_after_upload:
                shutil.rmtree(checkpoint.path, ignore_errors=True)
        reported = allgather_object((metrics, checkpoint is not None), name="train.report")
        if runtime.rank() == 0:
            any_checkpoint = any(has for _, has in reported)
            positions = {name: {"epoch": shard.epoch, "cursor": shard.cursor}
                         for name, shard in self._shards.items()}
            ray.get(self._run.reports.record.remote(
                folder if any_checkpoint else None, [m for m, _ in reported], positions))
        barrier()  # every rank returns once the report is recorded

    def _open_storage(self) -> Any:
        if self._storage is None:
            self._storage = open_storage(self._run.storage_path)
        return self._storage

    def get_checkpoint(self) -> Checkpoint | None:
        latest = ray.get(self._run.reports.latest.remote())
        return self._run.checkpoint(latest["checkpoint"]) if latest else None

    def get_all_reported_checkpoints(self, consistency_mode: Any = None,
                                     timeout_s: float | None = None) -> list[Any]:
        records = ray.get(self._run.reports.since.remote(0))
        return [ReportedCheckpoint(checkpoint=self._run.checkpoint(r["checkpoint"]),
                                   metrics=r["metrics"],
                                   status=ReportedCheckpointStatus.COMMITTED)
                for r in records if r["checkpoint"]]

    # ------------------------------------------------------------ data
    def get_dataset_shard(self, dataset_info: Any) -> Any:
        name = dataset_info.dataset_name
        if name in self._run.whole:
            return self._run.whole[name].iterator()
        if name not in self._run.feeds:
            known = sorted({*self._run.feeds, *self._run.whole})
            raise ConfigError(f"no dataset named {name!r} was given to the trainer "
                              f"(datasets={known})")
        if name not in self._shards:  # one per process: the object a TorchState commits
            feed = self._run.feeds[name]
            resume = (self._run.resume or {}).get("positions", {}).get(name)
            self._shards[name] = ElasticDataShard(
                feed, name, resume,
                on_commit=lambda p, feed=feed: feed.committed.remote(p["epoch"], p["cursor"]))
        return self._shards[name]

    # ------------------------------------------------------------ the rest
    def get_context(self) -> ElasticTrainContext:
        return self._context

    def get_preemption_info(self) -> Any:
        return None  # a draining node's workers leave at a commit, the others train on

    def is_distributed(self) -> bool:
        return True

    def barrier(self) -> None:
        barrier()

    def broadcast_from_rank_zero(self, data: Any) -> Any:
        return broadcast_object(data, 0, name="train.broadcast_from_rank_zero")


def install(run: RunInfo) -> None:
    """Makes `ray.train`'s worker functions answer from the elastic world in this process."""
    internals.set_train_fn_utils(ElasticTrainFnUtils(run))
