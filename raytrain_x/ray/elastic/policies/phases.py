"""The elastic job's phase, the typed changes that move it, and its transitions in one
table.

Each pass of the driver's loop observes the world; what it finds that the next round must
answer is a `Change` value (a worker failed, nodes drain, newcomers wait, a policy sends a
worker away, members wait at the rendezvous after losing a peer), made where it is found
and carried, unchanged, into the `RoundFormed` that answers it. The job's phase follows
them through `TRANSITIONS`; a change the table has no row for is a bug in the driver
(`next_phase` raises).

    STARTING --RoundFormed--> TRAINING --a change--> REFORMING --RoundFormed--> TRAINING
    TRAINING or REFORMING --WorkerFinished--> FINISHING --JobEnded--> ENDED
    any phase --JobEnded--> ENDED
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from raytrain_x.common.errors import InternalError


class Phase(enum.Enum):
    STARTING = "starting"  # no round has formed yet: the first workers start and join
    TRAINING = "training"  # the last round trains; nothing asks for another
    REFORMING = "reforming"  # a change asks for a round: it forms once its members wait
    FINISHING = "finishing"  # a worker finished the function: the others are collected
    ENDED = "ended"  # returned or raised


@dataclass(frozen=True)
class WorkerFailed:
    """A member failed (its process, node or call lost, or it raised), found by the
    driver's poll or its straggler rule. `lost_draining`: its node was draining, so its
    host is not blacklisted."""

    worker_id: str
    node: str
    rank: int
    cause: str
    lost_draining: bool = False


@dataclass(frozen=True)
class NodesDraining:
    """Nodes began draining (or left a host list, or were blacklisted there): their
    members leave at their next commit."""

    nodes: tuple[str, ...]


@dataclass(frozen=True)
class NewcomersWaiting:
    """Started workers wait at the rendezvous to join the next round."""

    count: int


@dataclass(frozen=True)
class AskedToLeave:
    """A driver policy sends a member away at its next commit."""

    worker_id: str
    policy: str
    reason: str


@dataclass(frozen=True)
class PeersWaiting:
    """Members wait at the rendezvous without a failure the driver saw: they lost a peer
    (their collective or rendezvous timed out) and left their round."""

    count: int


@dataclass(frozen=True)
class RoundFormed:
    """A round was published; `answers` are the changes it takes in."""

    round: int
    size: int
    answers: tuple[Change, ...] = ()


@dataclass(frozen=True)
class WorkerFinished:
    """A member returned from the function: the job is done."""

    worker_id: str


@dataclass(frozen=True)
class JobEnded:
    """The job returned its results or raised (`error`: the error's type, "" on success)."""

    error: str = ""


# what asks for a new round
Change = WorkerFailed | NodesDraining | NewcomersWaiting | AskedToLeave | PeersWaiting
CHANGES = (WorkerFailed, NodesDraining, NewcomersWaiting, AskedToLeave, PeersWaiting)
Event = Change | RoundFormed | WorkerFinished | JobEnded

# (phase, kind of event) -> the next phase; every pair a running job can meet has a row
TRANSITIONS: dict[tuple[Phase, type], Phase] = {
    **{(Phase.STARTING, kind): Phase.STARTING for kind in CHANGES},
    (Phase.STARTING, RoundFormed): Phase.TRAINING,
    **{(Phase.TRAINING, kind): Phase.REFORMING for kind in CHANGES},
    (Phase.TRAINING, RoundFormed): Phase.TRAINING,  # a round forming newcomers left out
    (Phase.TRAINING, WorkerFinished): Phase.FINISHING,
    **{(Phase.REFORMING, kind): Phase.REFORMING for kind in CHANGES},
    (Phase.REFORMING, RoundFormed): Phase.TRAINING,
    (Phase.REFORMING, WorkerFinished): Phase.FINISHING,
    **{(Phase.FINISHING, kind): Phase.FINISHING for kind in CHANGES},
    (Phase.FINISHING, WorkerFinished): Phase.FINISHING,
    **{(phase, JobEnded): Phase.ENDED for phase in Phase if phase is not Phase.ENDED},
}


def next_phase(phase: Phase, event: Event) -> Phase:
    """The phase after `event` (`TRANSITIONS`).

    Raises:
        InternalError: the table has no row for it (a bug in the driver).
    """
    try:
        return TRANSITIONS[(phase, type(event))]
    except KeyError:
        raise InternalError(f"the elastic driver met {type(event).__name__} in phase "
                            f"{phase.value}, which has no transition for it") from None
