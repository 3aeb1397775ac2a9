"""Every private Ray API raytrain-x calls, in one place, checked against the Ray versions
it was tested with.

Ray's public API has no way to read the draining nodes, the autoscaler's node types, the
free resources per node or the standing autoscaler request, or to drain a node from a test;
its GCS client and state API do. Those move between Ray releases, so they are called here
only, and importing this module checks Ray's version: below `SUPPORTED_FROM` raytrain-x
stops with a clear error, above `TESTED_UP_TO` it warns once. CI tests `TESTED_UP_TO`
(`requirements/dev-constraints.txt`).
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from raytrain_x.common.errors import ConfigError

SUPPORTED_FROM = (2, 60)  # the oldest Ray these calls were tested with
TESTED_UP_TO = (2, 60)  # the newest; later ones may move an API (a warning says so)
log = logging.getLogger("raytrain_x.ray")


def _version(text: str) -> tuple[int, int]:
    parts = [int(p) for p in text.split(".")[:2] if p.isdigit()]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def check_version(version: str = ray.__version__) -> None:
    """Raises for a Ray older than the supported one; warns for one newer than tested."""
    found = _version(version)
    if found < SUPPORTED_FROM:
        raise ConfigError(
            f"raytrain-x needs Ray >= {'.'.join(map(str, SUPPORTED_FROM))}, found {version}; "
            f"pip install 'ray>={'.'.join(map(str, SUPPORTED_FROM))}'")
    if found > TESTED_UP_TO:
        log.warning("raytrain-x was tested with Ray %s; Ray %s may have moved a private API "
                    "it uses (raytrain_x/ray/internals.py)",
                    ".".join(map(str, TESTED_UP_TO)), version)


check_version()


def available_resources_per_node() -> dict[str, dict[str, float]]:
    """Node id -> available resources (the GCS's view)."""
    from ray._private.state import available_resources_per_node as read

    return read()


def alive_actor_ids(class_name: str) -> set[str]:
    """Ids of the cluster's live actors of a class (the GCS's actor table; tests use it to
    check that a job left none of its actors behind)."""
    from ray._private.state import actors

    return {actor_id for actor_id, info in actors(actor_state_name="ALIVE").items()
            if info.get("ActorClassName", "").endswith(class_name)}


def draining_nodes_ms() -> dict[str, int]:
    """Node id -> drain deadline in ms since the epoch (0: none)."""
    from ray._private.state import state

    return state.get_draining_nodes()


def cluster_config() -> Any:
    """The autoscaler v2 cluster config the GCS holds (None without one)."""
    from ray._private.state import state

    return state.get_cluster_config()


def gcs_client(address: str) -> Any:
    """A client of the GCS at `address` (tests: node lists, drains, the KV store)."""
    return ray._raylet.GcsClient(address=address)


def autoscaler_request_channel() -> bytes:
    """The GCS KV key where `request_resources` leaves its request (autoscaler v1)."""
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL

    return AUTOSCALER_RESOURCE_REQUEST_CHANNEL


def fake_multi_node_provider() -> type:
    """Ray's fake multi-node autoscaler provider (`raytrain_x.testing.provider` extends it)."""
    from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider

    return FakeMultiNodeProvider


def _raylet_process_type() -> str:
    from ray._private import ray_constants

    return ray_constants.PROCESS_TYPE_RAYLET


RAYLET_PROCESS_TYPE = _raylet_process_type()  # a node's raylet, in its process table


# ------------------------------------------------------------ Ray Data and Ray Train
def dataset_ref_bundles(dataset: Any) -> Any:
    """The dataset's streaming execution as `RefBundle`s (`Dataset.iter_internal_ref_bundles`,
    a developer API of Ray Data)."""
    return dataset.iter_internal_ref_bundles()


def bundle_blocks(bundle: Any) -> list[tuple[Any, int | None]]:
    """A `RefBundle`'s blocks as (ObjectRef, rows), honouring its slices (Ray 2.60's
    `RefBundle.blocks` of `BlockEntry` and `RefBundle.slices`)."""
    out = []
    for entry, piece in zip(bundle.blocks, bundle.slices):
        if piece is not None and (piece.start_offset != 0 or
                                  piece.end_offset != entry.metadata.num_rows):
            raise ConfigError("a dataset whose stream hands out slices of blocks is not "
                              "supported by the elastic feed; materialize() it first")
        out.append((entry.ref, entry.metadata.num_rows))
    return out


# Private hooks of public Ray classes that raytrain-x overrides or calls (Ray 2.60), named here
# so an upgrade knows where to look; tests/unit/test_data_plan.py checks their signatures:
# - `ray.data.DataIterator._iter_batches(*, prefetch_batches, batch_size, batch_format,
#   drop_last, local_shuffle_buffer_size, local_shuffle_seed, _collate_fn, _finalize_fn)`,
#   which every public iteration method calls (`data_shard.ElasticDataShard` replaces it);
# - `DataParallelTrainer._get_train_func()` and its `train_run_context` and `data_config`
#   attributes (`elastic_trainer.fit_elastic` reads them).
DATA_ITERATOR_HOOK = ("prefetch_batches", "batch_size", "batch_format", "drop_last",
                      "local_shuffle_buffer_size", "local_shuffle_seed", "_collate_fn",
                      "_finalize_fn")


def set_train_fn_utils(utils: Any) -> None:
    """Installs what `ray.train.report`, `get_checkpoint`, `get_context` and
    `get_dataset_shard` call in this process (Ray Train v2's `TrainFnUtils`, the hook Ray
    documents as the one to replace for new behaviour)."""
    from ray.train.v2._internal.execution import train_fn_utils

    train_fn_utils.set_train_fn_utils(utils)


def train_fn_utils_base() -> type:
    """Ray Train v2's `TrainFnUtils` base class."""
    from ray.train.v2._internal.execution.train_fn_utils import TrainFnUtils

    return TrainFnUtils


def datasets_to_split(data_config: Any, names: list[str]) -> list[str]:
    """The datasets a Ray Train `DataConfig` splits over the workers (its
    `datasets_to_split`, kept private by Ray 2.60's `DataConfig`)."""
    chosen = getattr(data_config, "_datasets_to_split", "all")
    return list(names) if chosen == "all" else [n for n in names if n in chosen]


def tune_report_queue(callback: Any) -> Any:
    """The queue a Ray Tune `TuneReportCallback` hands a report to the Tune trial through
    (its `_training_actor_item_queue`, size 1), or None for another callback."""
    return getattr(callback, "_training_actor_item_queue", None)


def wait_tune_took_reports(queue: Any, timeout_s: float) -> bool:
    """Waits until the Tune trial has taken and handed on every report put in `queue`; False
    past `timeout_s`. The trial's session takes one item per result it hands to Tune and
    skips a falsy one (Ray 2.60's `_TrainSession._get_result_from_queues`); the queue holds
    one item, so an empty dict put behind the reports goes in once the last report is taken
    and is taken once that report went to Tune. A `fit()` that returns after this cannot
    have its trial's end overtake its last report."""
    import time

    from ray.util.queue import Full

    deadline = time.monotonic() + timeout_s
    try:
        queue.put({}, timeout=timeout_s)
    except Full:
        return False
    while not queue.empty():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
