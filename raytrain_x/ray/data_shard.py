"""What `ray.train.get_dataset_shard(name)` returns inside the elastic trainer: a Ray Data
`DataIterator` over the rank's share of each step of the epoch (`raytrain_x.ray.data_feed`),
and a `Position` (`raytrain_x.elastic.positions`) that a `TorchState` commits.

Its position is (epoch, cursor): the rows of the epoch handed out to the whole world so far,
the same number on every rank. Handing out a batch moves it, a commit keeps it, a failure
rolls it back with the model, and a new world goes on from it: every row of an epoch is
trained on once in the committed history, whatever the world did meanwhile. Each pass
(`iter_batches`, `iter_torch_batches`, `iter_rows`, ...) goes on from the position; a pass
that reaches the end of the epoch moves it to the next epoch's start.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import ray
from ray.data import DataContext, DataIterator
from ray.data.block import BlockAccessor

from raytrain_x.common.errors import ConfigError
from raytrain_x.core import runtime
from raytrain_x.elastic.positions import Position

__all__ = ["ROWS_PER_STEP_OF_ROWS", "ElasticDataShard"]
ROWS_PER_STEP_OF_ROWS = 256  # each rank's rows per step of `iter_rows` (no batch size given)
PLANNED_STEPS = 16  # steps asked of the feed in one call (fewer where rows are not there yet)
_END = object()


class ElasticDataShard(DataIterator, Position):
    """One dataset's rows for this rank, re-divided among the world at every step.

    Args:
        feed: the dataset's `DataFeed` actor.
        name: the dataset's name in `datasets=`.
        position: where to start ({"epoch", "cursor"}: a resumed run's, else the start).
        on_commit: called with the position when rank 0 commits it (the feed then lets go
            of the blocks no rank can roll back to).
    """

    def __init__(self, feed: Any, name: str, position: dict[str, int] | None = None,
                 on_commit: Callable[[dict[str, int]], None] | None = None) -> None:
        self._feed = feed
        self._name = name
        self._epoch = int((position or {}).get("epoch", 0))
        self._cursor = int((position or {}).get("cursor", 0))
        self._on_commit = on_commit

    # ------------------------------------------------------------ the position
    @property
    def epoch(self) -> int:
        """The epoch the next pass goes on with."""
        return self._epoch

    @property
    def cursor(self) -> int:
        """Rows of the epoch handed out to the whole world so far."""
        return self._cursor

    def state_dict(self) -> dict[str, int]:
        state = {"epoch": self._epoch, "cursor": self._cursor}
        if self._on_commit is not None and runtime.rank() == 0:
            self._on_commit(state)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._epoch, self._cursor = int(state["epoch"]), int(state["cursor"])

    # ------------------------------------------------------------ DataIterator
    def _to_ref_bundle_iterator(self) -> Any:  # pragma: no cover - _iter_batches is replaced
        raise NotImplementedError("the elastic shard hands out whole steps (_iter_batches)")

    def stats(self) -> str:
        return ray.get(self._feed.stats.remote()).__repr__()

    def schema(self) -> Any:
        return ray.get(self._feed.schema.remote())

    def get_context(self) -> DataContext:
        return DataContext.get_current()

    def _get_dataset_tag(self) -> dict[str, str | None]:
        return {"dataset": self._name, "split_index": str(runtime.rank())}

    def _iter_batches(self, *, prefetch_batches: int = 1, batch_size: int | None = 256,
                      batch_format: str | None = "default", drop_last: bool = False,
                      local_shuffle_buffer_size: int | None = None,
                      local_shuffle_seed: int | None = None,
                      _collate_fn: Callable[[Any], Any] | None = None,
                      _finalize_fn: Callable[[Any], Any] | None = None) -> Iterable[Any]:
        if local_shuffle_buffer_size is not None:
            raise ConfigError(
                "local_shuffle_buffer_size is not supported by the elastic trainer's shards: "
                "rows held in a shuffle buffer have no place in the epoch's position; "
                "shuffle upstream (ds.random_shuffle(seed=...) or randomize_block_order)")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ConfigError(f"batch_size must be a positive int (or None), got {batch_size!r}")
        per_rank = batch_size or ROWS_PER_STEP_OF_ROWS
        form = "numpy" if batch_format == "default" else batch_format

        def finish(block: Any) -> tuple[Any, Callable[[], None] | None]:
            """The batch of `block`, and what to call as it is handed out (Ray Data's
            finalize functions return the data with such a call: a device copy's wait)."""
            batch = block if form is None else BlockAccessor.for_block(block).to_batch_format(
                form)
            if _collate_fn is not None:
                batch = _collate_fn(batch)
            if _finalize_fn is None:
                return batch, None
            done = _finalize_fn(batch)
            return done.data, done.on_consume

        return _Passes(lambda: self._pass(per_rank, max(prefetch_batches, 1), drop_last,
                                          finish))

    def _pass(self, per_rank: int, depth: int, drop_last: bool,
              finish: Callable[[Any], Any]) -> Iterator[Any]:
        """One pass: from the position to the end of the epoch."""
        steps = _Steps(self._feed, self._epoch, self._cursor, runtime.size(), runtime.rank(),
                       per_rank, depth, finish)
        try:
            for rows, size, (batch, on_consume) in steps:
                self._cursor += rows  # handed out: a commit after this step keeps it
                if drop_last and size < per_rank:
                    continue
                if on_consume is not None:
                    on_consume()
                yield batch
            self._epoch, self._cursor = self._epoch + 1, 0
        finally:
            steps.close()


class _Passes:
    """An iterable whose every iteration is a new pass (as Ray Data's iterables are)."""

    def __init__(self, start: Callable[[], Iterator[Any]]) -> None:
        self._start = start

    def __iter__(self) -> Iterator[Any]:
        return self._start()


class _Steps:
    """Fetches a pass's steps on a thread, `depth` ahead of the training loop: each step's
    slices from the feed, its blocks from the object store, the batch made."""

    def __init__(self, feed: Any, epoch: int, cursor: int, world: int, rank: int,
                 per_rank: int, depth: int, finish: Callable[[Any], Any]) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._args = (feed, epoch, cursor, world, rank, per_rank, finish)
        self._thread = threading.Thread(target=self._fetch, daemon=True,
                                        name="raytrain-x data shard")
        self._thread.start()

    def __iter__(self) -> Iterator[tuple[int, int, Any]]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():  # free a fetch waiting to put
            try:
                self._queue.get(timeout=0.05)
            except queue.Empty:
                pass

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _fetch(self) -> None:
        feed, epoch, cursor, world, rank, per_rank, finish = self._args
        try:
            while not self._stop.is_set():
                for slices, rows in ray.get(feed.plan.remote(epoch, cursor, world, per_rank,
                                                             rank, PLANNED_STEPS)):
                    if rows == 0:
                        self._put(_END)
                        return
                    block = _rows(slices)
                    size = BlockAccessor.for_block(block).num_rows()
                    if not self._put((rows, size, finish(block))):
                        return
                    cursor += rows
        except BaseException as exc:  # noqa: BLE001 - raised in the training loop
            self._put(exc)


def _rows(slices: list[Any]) -> Any:
    """The rows of `slices` as one block (zero-copy for one Arrow slice)."""
    blocks = ray.get([s.ref for s in slices])
    parts = [BlockAccessor.for_block(b).slice(s.start, s.end, copy=False)
             for b, s in zip(blocks, slices)]
    if len(parts) == 1:
        return parts[0]
    import pyarrow as pa

    if all(isinstance(p, pa.Table) for p in parts):
        return pa.concat_tables(parts, promote_options="default")
    import pandas as pd

    return pd.concat([BlockAccessor.for_block(p).to_pandas() for p in parts],
                     ignore_index=True)
