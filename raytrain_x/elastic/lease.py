"""The writer lease: one run of a job writes its checkpoints at a time (no framework, no Ray).

A job's folder holds `lease.json`: the run that may write (`owner`, a token every worker of
the run shares), its `generation` (one more than any run before it) and when its holder
last renewed it. Epoch fencing as ZooKeeper and Kafka do it: a run takes the lease at its
first sync, before it writes anything, and checks it before every manifest it publishes
and every prune; a run whose lease was taken over finds a newer generation there and is
refused (`CheckpointLeaseHeld`), so a stale writer never overwrites or prunes a newer one.

A second run on a live job's path is refused with an error naming the holder. A lease is
live while its holder renews it (every `RENEW_S`, from rank 0); it expires `TTL_S` after
the last renewal, or at once when its holder was a process on this machine that is gone.
A lease whose holder has missed two renewals is waited out rather than refused: the same
command run again after the driver was killed resumes within `TTL_S`, on any machine.
`CheckpointConfig(takeover=True)` takes a live lease over, fencing the old run.

Storage offers no compare-and-swap through `pyarrow.fs`: two runs taking an expired lease
in the same instant both write it, and the one whose write landed last holds it; the other
reads the lease back, finds another owner and is refused.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass

from raytrain_x.common.errors import CheckpointLeaseHeld
from raytrain_x.elastic.checkpoints import CheckpointStore

log = logging.getLogger("raytrain_x.elastic")

LEASE = "lease.json"
RENEW_S = 3.0
TTL_S = 15.0


def new_owner() -> str:
    """A token naming one run of a job (shared by all its workers)."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class LeaseRecord:
    generation: int
    owner: str
    host: str
    pid: int
    renewed_at: float  # the holder's wall clock


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class WriterLease:
    """This run's lease on a job's folder (`store`), held by `owner`."""

    def __init__(self, store: CheckpointStore, owner: str,
                 clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.store, self.owner, self._clock, self._sleep = store, owner, clock, sleep
        self.generation = 0  # 0 until acquired

    def read(self) -> LeaseRecord | None:
        raw = self.store.storage.read(f"{self.store.root}/{LEASE}")
        if raw is None:
            return None
        try:
            return LeaseRecord(**json.loads(raw.decode()))
        except (TypeError, ValueError):
            return None  # a damaged lease names no live holder

    def _write(self, generation: int) -> None:
        record = LeaseRecord(generation, self.owner, socket.gethostname(), os.getpid(),
                             self._clock())
        self.store.storage.publish(f"{self.store.root}/{LEASE}",
                                   json.dumps(asdict(record)).encode())

    def live(self, record: LeaseRecord) -> bool:
        """Whether `record`'s holder may still be writing."""
        if record.host == socket.gethostname() and not _pid_alive(record.pid):
            return False
        return self._clock() - record.renewed_at < TTL_S

    def acquire(self, takeover: bool = False) -> int:
        """Takes the lease (or keeps it, where this run holds it already); returns this
        run's generation.

        Raises:
            CheckpointLeaseHeld: another run holds a live lease (and not `takeover`), or
                took the lease in the same instant.
            StorageError: storage cannot be written or read (the start's probe).
        """
        record = self.read()
        if record is not None and record.owner == self.owner:
            self.generation = record.generation
            self._write(self.generation)
            return self.generation
        if record is not None and self.live(record) and not takeover and \
                self._clock() - record.renewed_at > 2 * RENEW_S:
            wait = TTL_S - (self._clock() - record.renewed_at)
            log.warning("raytrain-x checkpoint: the run that held %s stopped renewing its "
                        "writer lease %.0fs ago; waiting %.0fs for it to expire",
                        self.store.where(), self._clock() - record.renewed_at, wait)
            self._sleep(max(0.0, wait))
            record = self.read()
        if record is not None and record.owner != self.owner and self.live(record) \
                and not takeover:
            age = self._clock() - record.renewed_at
            raise CheckpointLeaseHeld(
                f"another run of this job is writing its checkpoints at "
                f"{self.store.where()} (process {record.pid} on {record.host}, generation "
                f"{record.generation}, renewed {age:.0f}s ago). Stop it first; or wait "
                f"{max(0.0, TTL_S - age):.0f}s for its lease to expire if it is dead; or give "
                "CheckpointConfig(takeover=True) to fence it and continue from its latest "
                "checkpoint; or give this job another CheckpointConfig(name=...)")
        before = max([record.generation if record else 0, *self.store.generations()])
        self.generation = before + 1
        self._write(self.generation)
        self.check()  # a run that wrote the lease in the same instant wins or loses here
        return self.generation

    def renew(self) -> None:
        """Renews the lease (rank 0, every `RENEW_S`).

        Raises:
            CheckpointLeaseHeld: a newer run took it over.
        """
        self.check()
        self._write(self.generation)

    def check(self) -> None:
        """Before a manifest is published or checkpoints pruned: this run still holds the
        lease.

        Raises:
            CheckpointLeaseHeld: another run holds it (this run was fenced).
        """
        record = self.read()
        if record is None or record.owner != self.owner or \
                record.generation != self.generation:
            holder = "nobody" if record is None else \
                f"process {record.pid} on {record.host}, generation {record.generation}"
            raise CheckpointLeaseHeld(
                f"this run (generation {self.generation}) no longer holds the writer lease "
                f"of {self.store.where()}: {holder} does. Another run took the job over; "
                "this run's checkpoints are refused so that they cannot overwrite or prune "
                "the newer run's")
