"""Positions in a data stream that an elastic state commits beside the model.

A `Position` says how far an epoch has gone (what every rank has been handed), as a small
plain dict. A framework's state commits it with the rest, rolls it back with the rest and,
after a reset, gives every rank the new rank 0's: what is left of the epoch is then shared
by the new world, and nothing committed is handed out again. The Ray Data shards of the
elastic trainer (`raytrain_x.ray.data_shard`) are positions; a `TorchState` takes one as a
keyword, as it takes an `ElasticSampler`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class Position(ABC):
    """Where a stream of data stands; identical on every rank by construction."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The position as plain values (committed, broadcast, written to storage)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Puts the stream back where `state` says (a rollback, a sync, a restore)."""
