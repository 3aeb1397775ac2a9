"""The feed of one Ray Data dataset to an elastic job: a Ray actor on the driver's node that
runs the dataset's streaming execution, numbers its rows in the order they come, and
answers each rank which rows of a step are its (`raytrain_x.ray.data_plan`).

Why one feed and not Ray Train's `streaming_split`: a split gives each rank a stream of its
own, fixed when the world is made, and what a rank that died had not read cannot be given
to another. Here the ranks share one numbered stream and hold only a cursor into it, so a
new world goes on from the committed cursor, whatever its size.

Blocks are held from where a rank may still roll back to: a rank 0 that commits says so
(`committed`), and the feed lets go of the blocks before the second-newest commit it was
told of (ranks commit together, so a survivor of a failure holds at least that one). A
request for rows before what is held (a rollback to an older durable checkpoint, or a new
job resuming one) runs the epoch's stream again and skips to the cursor: the dataset runs
with `preserve_order`, so a deterministic dataset gives the same rows in the same order.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any

import ray

from raytrain_x.common.errors import ConfigError
from raytrain_x.ray import internals
from raytrain_x.ray.data_plan import block_slices, step_ranges
from raytrain_x.ray.placement import stable_node_strategy

__all__ = ["FEED_CONCURRENCY", "DataFeed", "Slice", "start_feed"]
FEED_CONCURRENCY = 64  # ranks asking at once (and prefetching), each call short


@dataclass(frozen=True)
class Slice:
    """Rows `[start, end)` of one block, handed to one rank."""

    ref: Any  # the block's ObjectRef
    start: int
    end: int
    rows: int  # the whole block's rows


class DataFeed:
    """One dataset's epochs as numbered row streams (a Ray actor: `start_feed`)."""

    def __init__(self, dataset: Any, name: str) -> None:
        self._dataset = dataset
        self._dataset.context.execution_options.preserve_order = True
        self._name = name
        self._lock = threading.Lock()
        self._epoch = -1
        self._stream: Any = None
        self._refs: list[Any] = []  # held blocks, in stream order
        self._starts: list[int] = []  # the row each held block begins at
        self._sizes: list[int] = []
        self._available = 0  # rows the stream has given this epoch
        self._ended = False
        self._commits: dict[int, list[int]] = {}  # epoch -> cursors rank 0 committed
        self._totals: dict[int, int] = {}  # epoch -> its rows, once its stream ended
        self.executions = 0  # epoch streams run (a rerun after a far rollback counts)
        self._ahead: _Ahead | None = None  # the next epoch's stream, started early

    def plan(self, epoch: int, cursor: int, world: int, per_rank: int, rank: int,
             steps: int = 1) -> list[tuple[list[Slice], int]]:
        """Rank `rank`'s slices of the steps from (`epoch`, `cursor`) on, of a `world` of
        ranks asking `per_rank` rows each, with the rows each step hands out in all; a step
        of 0 rows ends the epoch. Up to `steps` steps: the first waits for its rows, the
        others come only as far as the rows already held (one call a few steps ahead saves
        a call a step). An empty share is one empty slice, so the rank can still make an
        empty batch of the dataset's columns."""
        with self._lock:
            if epoch != self._epoch and cursor >= self._totals.get(epoch, cursor + 1):
                return [([], 0)]  # an epoch that was done already (a rollback to its end)
            if epoch != self._epoch or (self._starts and cursor < self._starts[0]):
                self._begin(epoch, cursor)
            out: list[tuple[list[Slice], int]] = []
            while len(out) < steps:
                ranges = step_ranges(cursor, world, per_rank, self._available, self._ended)
                if ranges is None:
                    if out:
                        break
                    self._pull()
                    continue
                if not ranges:
                    out.append(([], 0))
                    break
                start, end = ranges[rank]
                mine = [Slice(self._refs[i], first, last, self._sizes[i]) for i, first, last
                        in block_slices(self._starts, self._sizes, start, end)]
                if not mine:
                    mine = [Slice(self._refs[0], 0, 0, self._sizes[0])]
                rows = ranges[-1][1] - cursor
                out.append((mine, rows))
                cursor += rows
            return out

    def committed(self, epoch: int, cursor: int) -> None:
        """Rank 0 committed (`epoch`, `cursor`): blocks before the commit before it go."""
        with self._lock:
            seen = self._commits.setdefault(epoch, [])
            seen.append(cursor)
            for old in [e for e in self._commits if e < epoch]:
                del self._commits[old]
            if epoch != self._epoch or len(seen) < 2:
                return
            floor = sorted(set(seen))[-2] if len(set(seen)) > 1 else seen[0]
            while len(self._starts) > 1 and self._starts[1] <= floor:
                self._drop_first()

    def schema(self) -> Any:
        """The dataset's schema (Ray Data's `DataIterator.schema`)."""
        return self._dataset.schema()

    def stats(self) -> dict[str, int]:
        """What the feed holds and has done (tests, benchmarks)."""
        with self._lock:
            return {"epoch": self._epoch, "held_blocks": len(self._refs),
                    "available": self._available, "ended": int(self._ended),
                    "executions": self.executions}

    # ------------------------------------------------------------------ the stream
    def _begin(self, epoch: int, cursor: int) -> None:
        """Runs `epoch`'s stream from its start (or takes the one started ahead) and skips
        the rows before `cursor`."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.epoch == epoch:
            self._stream = ahead.stream()
        else:
            self._stream = iter(internals.dataset_ref_bundles(self._dataset))
        self.executions += 1
        self._epoch, self._available, self._ended = epoch, 0, False
        self._refs, self._starts, self._sizes = [], [], []
        while not self._ended and self._available <= cursor:
            self._pull()
            while len(self._starts) > 1 and self._starts[1] <= cursor:
                self._drop_first()

    def _pull(self) -> None:
        """Takes the stream's next bundle (waiting for it), or marks the epoch's end."""
        try:
            bundle = next(self._stream)
        except StopIteration:
            self._ended = True
            self._totals[self._epoch] = self._available
            self._ahead = _Ahead(self._dataset, self._epoch + 1)
            return
        for ref, rows in internals.bundle_blocks(bundle):
            if rows is None:
                raise ConfigError(f"dataset {self._name!r} gave a block without a row count")
            if rows:
                self._refs.append(ref)
                self._starts.append(self._available)
                self._sizes.append(rows)
                self._available += rows

    def _drop_first(self) -> None:
        del self._refs[0], self._starts[0], self._sizes[0]


class _Ahead:
    """The next epoch's stream, started on a thread as soon as an epoch's stream ends: a
    stream takes seconds to start (planning, launching its tasks, the first block), which
    the ranks would otherwise wait at every epoch's start while they finish the last."""

    def __init__(self, dataset: Any, epoch: int) -> None:
        self.epoch = epoch
        self._dataset = dataset
        self._first: list[Any] = []
        self._error: BaseException | None = None
        self._iterator: Any = None
        self._thread = threading.Thread(target=self._start, daemon=True,
                                        name="raytrain-x data feed ahead")
        self._thread.start()

    def _start(self) -> None:
        try:
            self._iterator = iter(internals.dataset_ref_bundles(self._dataset))
            self._first = [next(self._iterator)]
        except StopIteration:
            pass
        except BaseException as exc:  # noqa: BLE001 - raised where the epoch is asked for
            self._error = exc

    def stream(self) -> Any:
        """The stream, its first bundle included (waits for the start)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return itertools.chain(self._first, self._iterator)


def start_feed(dataset: Any, name: str) -> Any:
    """A `DataFeed` actor for `dataset`, on the driver's node (it lives as long as the job:
    a worker node's loss does not take it)."""
    actor = ray.remote(num_cpus=0, max_concurrency=FEED_CONCURRENCY)(DataFeed)
    return actor.options(scheduling_strategy=stable_node_strategy(),
                         name=None).remote(dataset, name)
