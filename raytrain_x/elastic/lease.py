"""The writer lease: one run of a job writes its checkpoints at a time (no framework, no Ray).

Epoch fencing, with the epochs ordered by storage itself: the job's folder holds
`lease/<generation>.json`, one file per run that took the job, each created with a
conditional write that fails where the file exists (`Storage.create`: a hard link on a
file system, S3's `If-None-Match: *`). The run holding the lease is the one whose file
has the highest generation; a run takes the lease by creating the next one, so two runs
can never hold one generation, and a run that took over is never undone by an older one's
late write: a renewal rewrites only its own generation's file. A run checks, before every
manifest it publishes and every prune, that no higher generation exists; one taken over
is refused (`CheckpointLeaseHeld`), so a stale writer never overwrites or prunes a newer
one's checkpoints.

Liveness is read on the reader's own monotonic clock, never by comparing hosts' wall
clocks: the holder rewrites its file every `RENEW_S` (a counter goes up), and a second
run watches it: a file that changes within `TTL_S` is a live holder (refused, naming it,
at its next renewal), one that does not is a dead one (taken). A holder that was a process
on this machine that is gone, or that released the lease at the end of its training, is
taken at once. `CheckpointConfig(takeover=True)` takes a live lease over, fencing the old
run.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from raytrain_x.common.errors import CheckpointLeaseHeld
from raytrain_x.elastic.checkpoints import CheckpointStore

log = logging.getLogger("raytrain_x.elastic")

LEASES = "lease"  # the folder of the generations' files
RENEW_S = 3.0
TTL_S = 15.0


def new_owner() -> str:
    """A token naming one run of a job (shared by all its workers)."""
    import uuid

    return uuid.uuid4().hex


@dataclass(frozen=True)
class LeaseRecord:
    generation: int
    owner: str
    host: str
    pid: int
    beat: int = 0  # renewals so far: what a reader watches change
    released: bool = False  # its run ended: the next may take it at once
    wall_time: float = 0.0  # the holder's clock, for people reading the file; never compared
    driver: str = ""  # `host:pid` of the job's driver, which renews it too ("": none)


def lease_file(generation: int) -> str:
    return f"{generation:012d}.json"


def _generation(name: str) -> int | None:
    stem, _, ext = name.partition(".")
    return int(stem) if ext == "json" and stem.isdigit() else None


def _gone(record: LeaseRecord) -> bool:
    """Whether every process renewing `record` (rank 0's, the driver's) was on this
    machine and is gone."""
    here = socket.gethostname()
    renewers = [(record.host, record.pid)]
    if record.driver:
        host, _, pid = record.driver.rpartition(":")
        renewers.append((host, int(pid) if pid.isdigit() else 0))
    return all(host == here and not _pid_alive(pid) for host, pid in renewers)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class WriterLease:
    """This run's lease on a job's folder (`store`), held by `owner`. `clock` is this
    process's monotonic clock: liveness is measured on it alone."""

    def __init__(self, store: CheckpointStore, owner: str,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, driver: str = "") -> None:
        self.store, self.owner, self._clock, self._sleep = store, owner, clock, sleep
        self.driver = driver  # `host:pid` of the job's driver, which renews it too
        self.generation = 0  # 0 until acquired
        self._beat = 0

    # ------------------------------------------------------------------ reading
    def _folder(self) -> str:
        return f"{self.store.root}/{LEASES}"

    def _path(self, generation: int) -> str:
        return f"{self._folder()}/{lease_file(generation)}"

    def generations(self) -> list[int]:
        """The generations whose files are in the folder, oldest first."""
        found = (_generation(e.name) for e in self.store.storage.list(self._folder())
                 if not e.is_dir)
        return sorted(g for g in found if g is not None)

    def read(self, generation: int) -> LeaseRecord | None:
        """A generation's record; None where it is missing or damaged (a damaged file
        still holds its generation: the order is the files' names)."""
        raw = self.store.storage.read(self._path(generation))
        try:
            return None if raw is None else LeaseRecord(**json.loads(raw.decode()))
        except (TypeError, ValueError):
            return None

    def holder(self) -> LeaseRecord | None:
        """The record of the highest generation, where there is one."""
        generations = self.generations()
        return None if not generations else self.read(generations[-1]) or LeaseRecord(
            generations[-1], "", "an unreadable lease file", 0)

    def _record(self, released: bool = False) -> bytes:
        record = LeaseRecord(self.generation, self.owner, socket.gethostname(), os.getpid(),
                             self._beat, released, time.time(), self.driver)
        return json.dumps(asdict(record)).encode()

    # ------------------------------------------------------------------ taking it
    def acquire(self, takeover: bool = False) -> int:
        """Takes the lease (or keeps it, where this run holds it already); returns this
        run's generation.

        Raises:
            CheckpointLeaseHeld: another run holds a live lease (and not `takeover`), or
                took the next generation in the same instant.
            StorageError: storage cannot be written or read.
        """
        generations = self.generations()
        top = self.read(generations[-1]) if generations else None
        if top is not None and top.owner == self.owner:
            self.generation = top.generation
            self.renew()
            return self.generation
        if generations and not takeover and self._live(generations[-1], top):
            top = self.read(generations[-1]) or top
            raise CheckpointLeaseHeld(
                f"another run of this job is writing its checkpoints at "
                f"{self.store.where()} ({_who(top)}, generation {generations[-1]}, renewing "
                f"its lease). Stop it first; or wait {TTL_S:.0f}s if it is dead (a lease "
                "nobody renews expires); or give CheckpointConfig(takeover=True) to fence it "
                "and continue from its latest checkpoint; or give this job another "
                "CheckpointConfig(name=...)")
        before = max([0, *generations, *self.store.generations()])
        self.generation, self._beat = before + 1, 0
        if not self.store.storage.create(self._path(self.generation), self._record()):
            mine = self.read(self.generation)  # our own create retried after it landed?
            if mine is None or mine.owner != self.owner:
                raise CheckpointLeaseHeld(
                    f"another run of this job took the writer lease of {self.store.where()} "
                    f"(generation {self.generation}) in the same instant as this one "
                    f"({_who(mine)}); this run writes no checkpoints. Stop one of the two")
        self._forget_older()
        self.check()
        return self.generation

    def _live(self, generation: int, record: LeaseRecord | None) -> bool:
        """Whether the holder of `generation` renews its lease: its file changes within
        `TTL_S` of this process's clock. A released lease, or one held by a process on
        this machine that is gone, is not live, at once."""
        if record is not None and (record.released or _gone(record)):
            return False
        first = self.store.storage.read(self._path(generation))
        began = self._clock()
        log.info("raytrain-x checkpoint: %s is held by %s (generation %d): watching whether "
                 "it renews the lease, up to %.0fs", self.store.where(), _who(record),
                 generation, TTL_S)
        while self._clock() - began < TTL_S:
            self._sleep(min(RENEW_S / 2, max(0.0, TTL_S - (self._clock() - began))))
            generations = self.generations()
            if generations and generations[-1] != generation:
                return True  # a third run took it meanwhile: refuse this one
            now = self.store.storage.read(self._path(generation))
            if now != first:
                return True
        log.warning("raytrain-x checkpoint: the lease of %s (%s, generation %d) was not "
                    "renewed for %.0fs: taking it", self.store.where(), _who(record),
                    generation, TTL_S)
        return False

    def _forget_older(self) -> None:
        """Deletes the files of generations before the one before this run's (best
        effort: they fence nothing once a higher one exists)."""
        for generation in self.generations():
            if generation < self.generation - 1:
                try:
                    self.store.storage.delete_file(self._path(generation))
                except Exception as exc:  # noqa: BLE001 - kept files do no harm
                    log.info("raytrain-x checkpoint: could not delete an old lease file: "
                             "%s", exc)

    # ------------------------------------------------------------------ holding it
    def renew(self) -> None:
        """Renews the lease (every `RENEW_S`): rewrites this run's own generation's file,
        so that it can never overwrite a newer run's.

        Raises:
            CheckpointLeaseHeld: a newer run took it over.
        """
        self.check()
        self.write_renewal()

    def write_renewal(self) -> None:
        """A renewal's write, after its check: this run's own generation's file, one beat
        on."""
        self._beat += 1
        self.store.storage.publish(self._path(self.generation), self._record())

    def release(self) -> None:
        """This run's training ended: the next run may take the lease at once (its own
        checks still pass until another takes it)."""
        self._beat += 1
        self.store.storage.publish(self._path(self.generation), self._record(released=True))

    def check(self) -> None:
        """Before a manifest is published or checkpoints pruned: no newer run took the
        lease. A missing or unreadable own file is still this run's (a newer run would
        have created a higher generation).

        Raises:
            CheckpointLeaseHeld: another run holds it (this run was fenced).
        """
        generations = self.generations()
        top = generations[-1] if generations else 0
        record = self.read(top) if top >= self.generation else None
        if top > self.generation or (record is not None and record.owner != self.owner):
            raise CheckpointLeaseHeld(
                f"this run (generation {self.generation}) no longer holds the writer lease "
                f"of {self.store.where()}: {_who(record)}, generation {top}, does. Another "
                "run took the job over; this run's checkpoints are refused so that they "
                "cannot overwrite or prune the newer run's")


def _who(record: LeaseRecord | None) -> str:
    return "a run whose lease file cannot be read" if record is None or not record.owner \
        else f"process {record.pid} on {record.host}"


class LeaseKeeper:
    """The job's driver's side of the writer lease: every `RENEW_S` it renews the lease
    its run's rank 0 took (found by the run's token, `owner`), so that the lease outlives
    rank 0's process and an elastic recovery that waits for capacity keeps it. It takes
    nothing: before rank 0 took the lease, after another run took it over, or once the run
    released it, it writes nothing. `stop()` releases it (the run ended)."""

    def __init__(self, store: CheckpointStore, owner: str) -> None:
        self.lease = WriterLease(store, owner, driver=driver_identity())

    def _ours(self) -> LeaseRecord | None:
        generations = self.lease.generations()
        record = self.lease.read(generations[-1]) if generations else None
        if record is None or record.owner != self.lease.owner or record.released:
            return None
        self.lease.generation = record.generation
        self.lease._beat = max(self.lease._beat, record.beat)
        return record

    def renew(self) -> None:
        """One renewal, if the run holds the lease (storage errors logged: the next try
        may pass before the lease expires)."""
        try:
            if self._ours() is not None:
                self.lease.write_renewal()
        except Exception as exc:  # noqa: BLE001 - rank 0 renews too; the next may pass
            log.info("raytrain-x checkpoint: the driver could not renew the writer lease: "
                     "%s", exc)

    def stop(self) -> None:
        """The run ended: its lease is released, if it still holds it (best effort)."""
        try:
            if self._ours() is not None:
                self.lease.release()
        except Exception as exc:  # noqa: BLE001 - it expires instead
            log.info("raytrain-x checkpoint: could not release the writer lease: %s", exc)


def driver_identity() -> str:
    """`host:pid` of this process (a driver names itself in its run's lease)."""
    return f"{socket.gethostname()}:{os.getpid()}"
