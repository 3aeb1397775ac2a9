"""Errors raised by raytrain-x. Every message says what happened and what to do next."""

from __future__ import annotations

import traceback


class RaytrainXError(Exception):
    """Base class of every error raytrain-x raises."""

    # Exception's own constructor, named as such: TensorFlow's AutoGraph re-raises an
    # error from a traced function as its own type only then (else as a StagingError),
    # so a bad argument inside `tf.function` still raises ConfigError.
    __init__ = Exception.__init__


class ConfigError(RaytrainXError, ValueError):
    """A flag, knob, file or argument has a bad value; the message names it and the fix."""


class UnsupportedOperationError(ConfigError, RuntimeError):
    """A collective asked for an op it does not have (reducescatter with Adasum, ...): a
    bad argument, and a RuntimeError, as Horovod raises it."""


class TensorMismatchError(RaytrainXError, RuntimeError):
    """Ranks disagree on a tensor's shape, dtype or op (found during negotiation)."""


class InternalError(RaytrainXError, RuntimeError):
    """A peer or the transport failed; elastic training restores the last commit."""


class LocalError(RaytrainXError, RuntimeError):
    """This rank's engine failed on its own (a full disk under the timeline, out of memory
    in a fusion buffer, a bug), not because a peer did: raised as itself, never taken for
    a lost peer. An elastic job does not retry it in place; its peers lose this rank and
    recover, the driver sees the real cause, and a job whose every rank meets it stops with
    it. The error it wraps is its `__cause__`."""


class WorkerError(RaytrainXError):
    """A worker's function raised or its process exited; carries the rank and traceback.

    Args:
        rank: the failing worker's rank.
        detail: the remote traceback or exit description.
        lost_peer: the worker failed only because a peer did (it raised `InternalError` or
            `RendezvousTimeout`), so another rank's failure is the root cause.
        process_lost: its process or host was lost (killed, crashed, cut off), as opposed
            to its function raising.
        state_lost: the message of the `ElasticStateLost` the worker raised (a part of the
            committed state it needed is gone with every copy), or None.
    """

    def __init__(self, rank: int, detail: str, lost_peer: bool = False,
                 process_lost: bool = False, state_lost: str | None = None) -> None:
        # rank -1: an elastic worker that failed before it joined a round (its script's
        # import, say) has no rank yet
        who = f"rank {rank}" if rank >= 0 else "a worker (before it joined a round)"
        super().__init__(f"{who} failed:\n{detail}")
        self.rank = rank
        self.detail = detail
        self.lost_peer = lost_peer
        self.process_lost = process_lost
        self.state_lost = state_lost

    def __reduce__(self):
        return (WorkerError, (self.rank, self.detail, self.lost_peer, self.process_lost,
                              self.state_lost))

    @property
    def cause(self) -> str:
        """`process_lost` (killed, crashed or cut off), `lost_peer` (it failed only because a
        peer did) or `error` (its function raised)."""
        return ("process_lost" if self.process_lost else
                "lost_peer" if self.lost_peer else "error")


class HostsUpdatedInterrupt(RaytrainXError):
    """Hosts were added or removed; elastic training re-forms the world keeping its state.

    Args:
        skip_sync: True when no state sync is needed after the reset (only additions).
    """

    def __init__(self, skip_sync: bool = False, message: str | None = None) -> None:
        super().__init__(message or "the set of hosts changed; re-forming the worker group")
        self.skip_sync = skip_sync


class RendezvousTimeout(RaytrainXError):
    """Workers did not all arrive at a rendezvous in time."""


class PlacementTimeout(RendezvousTimeout, TimeoutError):
    """The cluster could not fit the workers within `placement_group_timeout_s` (a
    `TimeoutError`, as Horovod's Ray executor raises)."""


class StoreAuthError(RaytrainXError, RuntimeError):
    """A job's rendezvous store and a process disagree on the job's secret (one of them is
    not of this job)."""


class StorageError(RaytrainXError, OSError):
    """Durable storage failed an operation after its retries (a listing, a read, a write):
    the message names the path and the cause. It never reads as "no checkpoint"."""


class CheckpointError(RaytrainXError, RuntimeError):
    """A durable checkpoint could not be written or restored (`state.checkpoint()` raises
    it naming the path and the cause), or storage holds another job's state."""


class CheckpointLeaseHeld(CheckpointError):
    """Another run of the job holds its writer lease in storage (a second driver on a live
    job's path), or a newer run took it over and fenced this one."""


class ResetLimitExceeded(RaytrainXError):
    """An elastic job reset more often than its reset_limit allows."""


class FailureLimitExceeded(RaytrainXError):
    """An elastic job's workers failed more often than its `max_failures` allows (the
    elastic trainer's `FailureConfig(max_failures)`; a drained node's workers are not a
    failure)."""


class ElasticStateLost(RaytrainXError):
    """Every worker holding an elastic job's committed state was lost: the state lived only
    in their memory, and a new round would silently start over from the initial state."""


class ControlActorLost(ElasticStateLost):
    """An elastic job's rounds or store actor (on the head node) died: no round can form
    without it, so every worker is ended with it. A job with durable checkpoints starts
    again from its latest one; without, this is where it stops."""


class ElasticTimeout(RaytrainXError):
    """An elastic job had fewer than `min_workers` workers for longer than
    `elastic_timeout`."""


class ElasticJobStopped(RaytrainXError, RuntimeError):
    """The elastic job's controller stopped (it failed or was shut down) while a worker
    waited for its next round."""


class AutotuneError(RaytrainXError, RuntimeError):
    """The autotune search's process ended or failed; training goes on with the knobs it
    has."""


# Errors a worker raises when it only lost a peer (another rank's failure is the cause).
LOST_PEER_ERRORS = (InternalError, RendezvousTimeout)
# A process launched by `raytrain-x run` exits with this code when it ends on one of them.
LOST_PEER_EXIT_CODE = 75


__all__ = [
    "RaytrainXError",
    "ConfigError",
    "TensorMismatchError",
    "UnsupportedOperationError",
    "InternalError",
    "LocalError",
    "WorkerError",
    "HostsUpdatedInterrupt",
    "RendezvousTimeout",
    "PlacementTimeout",
    "StoreAuthError",
    "ResetLimitExceeded",
    "FailureLimitExceeded",
    "ElasticTimeout",
]


def local_error(exc: BaseException) -> LocalError:
    """`exc`, raised in this rank's own engine, as a `LocalError` chained to it."""
    error = LocalError(f"this rank failed on its own (not a lost peer): "
                       f"{type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def drop_tracebacks(exc: BaseException) -> None:
    """Drops the tracebacks of `exc` and the errors it chains, and the locals of their
    finished frames. A collective that failed leaves its process group, and its pending
    work, in them (a frame keeps its function, and the function's closure); a gloo group
    closes its connections, which tells peers this rank is gone, only once it is freed.
    Measured: without this, a rank that did not talk to the lost one waited for the
    collective timeout (10 s) instead of 0.1 s."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__
