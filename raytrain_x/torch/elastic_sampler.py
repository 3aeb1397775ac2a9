"""`ElasticSampler`: a dataset sharded over the current workers, re-sharded after an elastic
reset so that what is left of the epoch is seen once (Horovod's sampler)."""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterator
from typing import Any

import torch

from raytrain_x.core.runtime import rank, size

log = logging.getLogger("raytrain_x.elastic")


class ElasticSampler(torch.utils.data.Sampler):
    """Shards a dataset over the current workers and remembers what was processed in this
    epoch, so that an elastic reset re-shards only what is left (Horovod's sampler).

    Put it in a `TorchState` (any keyword) and record each batch with `record_batch`; a
    commit then keeps the epoch's progress, a restore goes back to the committed progress,
    and after a reset the remaining samples are re-shared among the new set of workers.

    The epoch's order is Horovod's: every index, shuffled with `seed + epoch` (the same on
    every rank); what is left is that order without the processed indices, dealt to the
    ranks in turn (rank r takes positions r, r + size, ...). As with `DistributedSampler`,
    each rank's shard is padded (with samples from the start of what remains) to an equal
    length, so that every rank runs the same number of steps.

    Horovod's fields are kept: `processed_num` (samples of this epoch processed, over every
    rank), and `state_dict()` / `load_state_dict()` with `epoch` and `processed_num` (a
    Horovod state dict loads: its `processed_num` first samples of the epoch's order are
    the processed ones). Beside them the sampler records exactly which indices were
    processed (`processed_indices`), which a count cannot say after a reset re-dealt the
    samples.

    Args:
        dataset: anything with `len()`.
        shuffle: shuffle the epoch's indices with `seed + epoch`.
        seed: base of the shuffle's seed.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        # record_indices was used: each rank holds only its own records, combined at a sync
        self.rank_local_records = False
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self._padded: list[int] = []
        self.indices: list[int] = []
        self._past_end_warned = False
        self.reset()

    @property
    def processed_num(self) -> int:
        """Samples of this epoch processed so far, over every rank (Horovod's field)."""
        return len(self.processed_indices)

    @processed_num.setter
    def processed_num(self, value: int) -> None:
        self.processed_indices = set(self._order()[:max(0, int(value))])

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch `epoch`: nothing processed yet, a new shuffle."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Records batch `batch_idx` (counted from the start of this iteration) as done on
        every rank: data-parallel ranks step together, so each rank records the others'
        rows of the same batch too, and a commit holds the whole world's progress with no
        communication (a failed rank's committed batches are not done again).

        An index past the end of this iteration's shard (a script that keeps counting its
        batches across a reset, as Horovod's count allows) records the next
        `batch_size * num_replicas` unprocessed samples in the epoch's order instead, as
        Horovod's `processed_num += batch_size * num_replicas` does."""
        start = batch_idx * batch_size
        if 0 <= start < self.num_samples:
            for replica in range(self.num_replicas):
                shard = self._padded[replica:self.total_size:self.num_replicas]
                self.processed_indices.update(shard[start:start + batch_size])
            return
        left = [i for i in self._order() if i not in self.processed_indices]
        if not left and not self._past_end_warned:
            self._past_end_warned = True
            log.warning("raytrain-x: ElasticSampler.record_batch(%d, %d) after every sample "
                        "of epoch %d was recorded; call set_epoch() at each epoch's start",
                        batch_idx, batch_size, self.epoch)
        self.processed_indices.update(left[:batch_size * self.num_replicas])

    def record_indices(self, indices: Any) -> None:
        """Records dataset indices processed by this rank only; after a reset the survivors'
        records are combined (a failed rank's are lost, as in Horovod)."""
        self.rank_local_records = True
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's dataset indices of batch `batch_idx`."""
        start = batch_idx * batch_size
        return self.indices[start:min(start + batch_size, len(self.indices))]

    def state_dict(self) -> dict[str, Any]:
        """Horovod's `epoch` and `processed_num`, and the exact `processed_indices`."""
        return {"epoch": self.epoch, "processed_num": self.processed_num,
                "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads `state_dict()`'s, or Horovod's (`epoch` and `processed_num` only)."""
        self.epoch = state_dict["epoch"]
        if "processed_indices" in state_dict:
            self.processed_indices = set(state_dict["processed_indices"])
        else:
            self.processed_num = state_dict.get("processed_num", 0)
        self.reset()

    def _order(self) -> list[int]:
        """Every index of the dataset in this epoch's order."""
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def reset(self) -> None:
        """Re-shards what is left of the epoch over the current world."""
        self.num_replicas, self.rank = size(), rank()
        remaining = [i for i in self._order() if i not in self.processed_indices]
        self.remaining_indices = remaining
        self.num_samples = math.ceil(len(remaining) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        padded = list(remaining)
        while remaining and len(padded) < self.total_size:
            padded += remaining[:self.total_size - len(padded)]
        self._padded = padded
        self.indices = padded[self.rank:self.total_size:self.num_replicas]
        self._past_end_warned = False

    def __iter__(self) -> Iterator[int]:
        self.indices = self._padded[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
