"""Worker-side elastic state: commit, restore, sync from the new rank 0, and `run`.

The decorated function must not run collectives before it is called: a worker that joins
a running job gets its state from rank 0 in the first `sync()`, inside `run`.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from raytrain_x.common.errors import ConfigError, HostsUpdatedInterrupt, InternalError
from raytrain_x.common.process import PROCESS
from raytrain_x.core import runtime, world
from raytrain_x.core.objects import broadcast_object, max_ints
from raytrain_x.elastic.commits import CommitManager, Committed, copied
from raytrain_x.elastic.positions import Position

log = logging.getLogger("raytrain_x.elastic")


BroadcastObject = Callable[..., Any]  # (obj, root_rank, name=...) -> root's obj

def state_round() -> int:
    """The rendezvous round of the state this process holds: the round in which it last
    committed, or synced the state from rank 0 inside `run` (0: it never synced, and
    holds only its initial state). The elastic driver reads it at each rendezvous: a
    worker holds the job's latest state when this is no older than the last round that
    committed; it needs one such holder in every round, or the state is lost."""
    return PROCESS.state_round


def holds_state() -> bool:
    """Whether this process holds the job's state (synced inside `run`; `state_round`)."""
    return PROCESS.state_round > 0


def restore_count() -> int:
    """How many times `run` restored the last commit in this process (each time a peer
    or the transport failed). A job whose workers only come and go through commits, as
    when a draining node's workers leave, restores nothing."""
    return PROCESS.restores


class HostMessages:
    """What Horovod's `State._host_messages` queue tells a script: whether the driver has
    hosts this world has not met yet (the next commit then raises `HostsUpdatedInterrupt`).
    Empty outside an elastic job."""

    def empty(self) -> bool:
        probe = runtime.host_update_probe()
        return probe is None or probe()[0] == runtime.rendezvous().hosts_version

    def qsize(self) -> int:
        return 0 if self.empty() else 1


def check_attribute_names(state_type: type, names: Iterable[str]) -> None:
    """A state's user attributes take any name but the state's own: a method, a property
    or a private member (leading `_`) of `state_type`.

    Raises:
        ConfigError: naming the attribute that collides.
    """
    kind = state_type.__name__
    for name in names:
        if name.startswith("_"):
            raise ConfigError(f"{kind}({name}=...): names that start with '_' are kept for "
                              f"the state's own members; name the attribute without it")
        if hasattr(state_type, name):
            raise ConfigError(f"{kind}({name}=...): {name!r} is {kind}.{name}, part of the "
                              f"state's API; name the attribute otherwise (e.g. {name}_)")


class State:
    """Base of elastic states: what survives a failure is what was last committed.

    The commit state (the number, the committed copy, durable checkpoints) has one owner,
    the state's `CommitManager` (`raytrain_x.elastic.commits`); a state built on
    `ObjectState` gives it a format. A state of one's own (Horovod's way: `save`,
    `restore` and `sync` written by hand) works too, without durable checkpoints.

    Args:
        bcast_object: how to send a Python object from rank 0 to every rank,
            `bcast_object(obj, root_rank, name=...)`; a framework's state passes its own
            (Horovod's `common/elastic.py` does the same). Default: the core's, which needs
            no framework.
        get_rank: this worker's rank (default: the core's).
    """

    _commits: CommitManager | None = None  # where a state has a format (`ObjectState`)

    def __init__(self, *, bcast_object: BroadcastObject | None = None,
                 get_rank: Callable[[], int] | None = None) -> None:
        self._bcast_object = bcast_object or broadcast_object
        self._get_rank = get_rank or runtime.rank
        self._reset_callbacks: list[Callable[[], None]] = []

    @property
    def _host_messages(self) -> HostMessages:
        """Horovod's queue of host updates, as Horovod's scripts read it (`empty()`)."""
        return HostMessages()

    @property
    def restored_from(self) -> Any:
        """The checkpoint's manifest this process last restored from storage (None: none)."""
        return self._commits.restored_from if self._commits is not None else None

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Functions run after every reset (e.g. to rescale the learning rate by size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def peer_failed(self, exc: BaseException) -> bool:
        """Whether `exc`, raised by the training function, is a lost peer that the state's
        own collectives report in their own way (torch's process group under an FSDP2
        model): `run` then restores the last commit, as for `InternalError`."""
        return False

    def syncs_after_every_reset(self) -> bool:
        """True when the state is laid out for one world (a sharded optimizer's), so that
        it is synced after every reset, even one raised with `skip_sync=True`."""
        return self._commits is not None and self._commits.shards is not None

    def commit(self) -> None:
        """Saves the state in memory, then checks for added or removed hosts (raising
        `HostsUpdatedInterrupt` on every rank at once when the world should change)."""
        self.save()
        if PROCESS.state_round:  # it synced inside `run`: this commit is the job's progress
            CommitManager.note_synced()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises `HostsUpdatedInterrupt` when the driver has new hosts for this job. Rank 0
        asks and broadcasts the answer, so every rank raises at the same commit. With
        durable checkpoints, rank 0's answer also says whether this commit is written to
        storage (it is due, or the driver asked for it), and every rank writes its part of it
        first."""
        probe = runtime.host_update_probe()
        commits = self._commits
        due = commits.due() if commits is not None else None
        if probe is None and due is None:  # the same on every rank
            return
        # every rank adds the id of its last write whose part failed: rank 0 learns of it
        # at this commit, not through the storage that failed the part
        failed = commits.failed_write() if commits is not None else 0
        answer = [0, 0, failed]
        if self._get_rank() == 0:  # a due checkpoint gets a write id, the same on every rank
            version, asked = probe() if probe is not None else (0, False)
            if asked and commits is not None:
                commits.ask()
            answer = [version, time.time_ns() if commits is not None and commits.due() else 0,
                      failed]
        # three integers in one small allreduce (the largest of each: the others pass 0
        # for rank 0's two), which the engine sends with its readiness in one round trip
        # once it repeats (each commit), not an object's two broadcasts
        version, write_id, failed = max_ints(answer, name="elastic.hosts_version")
        if failed and commits is not None and self._get_rank() == 0:
            commits.failed_elsewhere(failed)
        if write_id and commits is not None:
            commits.write(write_id)
        if probe is not None and version != runtime.rendezvous().hosts_version:
            if commits is not None:  # every rank alike: its copies land before the round
                commits.settle()
            raise HostsUpdatedInterrupt(skip_sync=False)

    def ended(self) -> None:
        """The elastic function returned: the next run of the job may take the writer
        lease at once."""
        if self._commits is not None:
            self._commits.ended()

    def finish_writes(self) -> None:
        """Waits for this rank's durable write under way, if any (before leaving the job),
        up to the checkpoint's `write_timeout_s`."""
        if self._commits is not None:
            self._commits.finish_writes()

    def checkpoint(self, timeout_s: float | None = None) -> None:
        """Writes the last commit to durable storage now and returns once the checkpoint is
        complete (at the end of training, before a planned stop). A collective: call it on
        every rank at the same place.

        Raises:
            ConfigError: the state writes no durable checkpoints (give `checkpoint=`).
            CheckpointError: the checkpoint could not be written or completed (on every
                rank alike), naming the path and the cause.
        """
        if self._commits is None or self._commits.durable is None:
            kind = type(self).__name__
            raise ConfigError(f"this {kind} has no durable checkpoints: give {kind}(..., "
                              "checkpoint=CheckpointConfig(storage_path=...)) or "
                              "RayExecutor(..., checkpoint=...)")
        self._commits.checkpoint(timeout_s)

    def save(self) -> None:
        if self._commits is None:
            raise NotImplementedError
        self._commits.commit()

    def restore(self) -> None:
        if self._commits is None:
            raise NotImplementedError
        self._commits.rollback()

    def sync(self) -> None:
        if self._commits is None:
            raise NotImplementedError
        self._commits.sync()


class ObjectState(State):
    """Plain Python attributes, broadcast from rank 0 on sync.

    Example: `state = ObjectState(epoch=0, batch=0)`; `state.epoch += 1`; `state.commit()`.
    """

    def __init__(self, *, bcast_object: BroadcastObject | None = None,
                 get_rank: Callable[[], int] | None = None, **kwargs: Any) -> None:
        check_attribute_names(type(self), kwargs)
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)
        self._names = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._commits = self._commit_manager()
        self._commits.take()

    def _commit_manager(self) -> CommitManager:
        """The commit manager of this state (a framework's state gives its own format)."""
        return CommitManager(Attributes(self, self._names, self._bcast_object),
                             self._bcast_object)


class Attributes:
    """The format of an `ObjectState`: its named plain attributes, deep-copied (no durable
    checkpoints: a framework's state writes those). An attribute that is a data stream's
    `Position` (the elastic trainer's Ray Data shard) is committed as its `state_dict()`
    and loaded back into the same object."""

    layout = "objects"
    info: dict[str, Any] = {}

    def __init__(self, owner: Any, names: list[str], bcast_object: BroadcastObject) -> None:
        self._owner, self._names, self._bcast = owner, names, bcast_object

    def values(self) -> dict[str, Any]:
        out = {}
        for name in self._names:
            value = getattr(self._owner, name)
            out[name] = value.state_dict() if isinstance(value, Position) else value
        return out

    def take(self) -> Committed:
        return copied(copy.deepcopy(self.values()), copy.deepcopy)

    def load(self, tree: Any) -> None:
        """Loads the attributes of this state's own among `tree`'s (a checkpoint's may hold
        some it no longer has: `durable.check_signature`)."""
        for name, value in tree.items():
            if name not in self._names:
                continue
            current = getattr(self._owner, name, None)
            if isinstance(current, Position):
                current.load_state_dict(value)
            else:
                setattr(self._owner, name, value)

    def sync_from(self, root: int) -> None:
        self.load(self._bcast(self.values(), root, name="elastic.object_state"))

    def signature(self) -> dict[str, Any]:
        return {"attributes": sorted(self._names)}

    def save(self, tree: Any, folder: str) -> None:
        raise NotImplementedError("an ObjectState writes no durable checkpoints")

    def read(self, part: Any) -> Any:
        raise NotImplementedError("an ObjectState writes no durable checkpoints")


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Makes `func(state, *args, **kwargs)` elastic.

    On `InternalError` (a peer or the transport failed; or what the state's `peer_failed`
    says is one, such as torch's process group under an FSDP2 model) the state is
    restored to its last commit; on `HostsUpdatedInterrupt` it is kept. Either way the
    worker re-initialises through a new rendezvous round (the tuned knobs carry over), runs
    the reset callbacks, syncs the state from the new rank 0 (the oldest surviving worker)
    and calls `func` again.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        reset_required = False
        skip_sync = False
        elastic = True  # a driver forms new rounds; a fixed world cannot go on without a rank
        while True:
            reset_failed = False
            try:  # a peer may die during the reset and the sync too: same recovery
                if reset_required:
                    try:
                        world.reset()
                    except InternalError:
                        reset_failed = True
                        raise
                    except HostsUpdatedInterrupt:
                        raise
                    except BaseException:  # it leaves the job (a drain) or the job stopped
                        state.finish_writes()
                        raise
                    state.on_reset()
                if not skip_sync or (reset_required and state.syncs_after_every_reset()):
                    state.sync()
                    CommitManager.note_synced()
                result = func(state, *args, **kwargs)
                state.ended()
                return result
            except HostsUpdatedInterrupt as exc:
                skip_sync = exc.skip_sync
            except Exception as exc:
                if not (isinstance(exc, InternalError) or state.peer_failed(exc)):
                    raise
                if reset_failed and not elastic:
                    raise InternalError(
                        f"a rank of this fixed-size world failed, and the world cannot form "
                        f"again without it ({exc}); a fixed world stops here. To train on "
                        "without a lost worker, run the job elastic (ElasticRayExecutor "
                        "with min_workers, or raytrain-x run --min-num-proc)") from exc
                elastic = elastic and _formed_by_a_driver()
                log.warning("raytrain-x elastic: %s; restoring the last commit", exc)
                CommitManager.note_rollback()
                state.restore()
                skip_sync = False
            reset_required = True

    return wrapper


def _formed_by_a_driver() -> bool:
    """Whether an elastic driver formed this world (it forms the next round without a lost
    rank); False for a fixed world, which a lost rank ends."""
    try:
        return bool(runtime.rendezvous().elastic)
    except Exception:  # noqa: BLE001 - no world to ask: reset as before
        return True
