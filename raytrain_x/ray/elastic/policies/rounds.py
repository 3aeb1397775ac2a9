"""Rounds: whether and how the next round forms, who leaves and who stays, and whether
the job's committed state survives."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from raytrain_x.common.errors import (
    ElasticStateLost,
)
from raytrain_x.ray.elastic.policies.views import MemberView


def state_lost(staying: Iterable[str], holders: Iterable[str], committed: bool) -> bool:
    """Whether the job's committed state is gone: it committed, and none of the `staying`
    workers holds the state (each says so when it joins a round: it synced the state in an
    earlier one). The state lives only in the workers' memory: a round of newcomers would
    start over from the initial state."""
    return committed and not set(staying) & set(holders)


def state_lost_error(last_failure: object, workers_lost: int) -> ElasticStateLost:
    """The error of a job whose every state holder was lost (`state_lost`)."""
    return ElasticStateLost(
        f"every worker that held the job's committed state was lost ({workers_lost} "
        f"workers failed in all; the last: {_failure_summary(last_failure)}). A new round "
        "would start over from the initial state, so the job stops instead (with "
        "RayExecutor(checkpoint=CheckpointConfig(...)) it restores the latest complete "
        "durable checkpoint; none was complete, or none is configured). With faults this "
        "frequent, run more workers or a higher min_workers so that one of them survives.")


def _failure_summary(value: object) -> str:
    """A failure as one line: its first two non-empty lines, joined."""
    lines = [line for line in str(value or "no failure recorded").splitlines() if line.strip()]
    return "; ".join(lines[:2])[:300]


@dataclass(frozen=True)
class RoundDecision:
    leave: list[str]  # members at the rendezvous to send away (their node drains)
    form: bool  # form the round now, of `ranks`
    ranks: list[str]  # the members the round is formed of
    interrupt: bool = False  # newcomers wait while the round's members train: ask them over
    # members of the last round on a draining node, not at the rendezvous yet, that the
    # round forms without (they are sent away when they arrive): they left with this round
    departed: list[str] = field(default_factory=list)
    # members on a draining node kept in the round: no staying member holds the state yet
    kept: list[str] = field(default_factory=list)
    # the last round, which kept members on a draining node, has committed (so everyone in
    # it holds the state): ask its members over, and the drained ones leave
    release: bool = False
    # how many more workers must wait at the rendezvous before a join can change this
    # decision (0: the round forms now): the driver's join watch wakes it then, not at
    # every join of a large round
    awaits: int = 0


def kept_on_drain(members: Iterable[MemberView], draining: Iterable[str],
                  holders: Iterable[str] | None, waiting: Iterable[str]) -> set[str]:
    """Members on a draining node that stay in the job's rounds for now:

    - those that hold the job's latest committed state (`holders`, from the rounds actor;
      None before the job's first commit) while no member that stays holds it and waits
      at the rendezvous (one on its way may have died unseen). Sent away, they would take
      the job's only copy of its state with them; kept, the staying members sync it from
      them in the next round, and they leave at the rendezvous after its first commit. A
      member the last round formed without (`departed`) is one while that round has not
      committed;
    - every member of a last round that is all on draining nodes (no staying member was
      in it, none departed from it): it trains on until its next commit, and a round
      formed without it would train beside it from an older state."""
    draining, waiting = set(draining), set(waiting)
    members = [m for m in members if not m.leaving]
    staying = [m for m in members if not m.drains(draining)]
    drained = [m for m in members if m.drains(draining)]
    kept = set()
    if not any(m.in_round for m in staying):
        kept = {m.worker_id for m in drained if m.in_round and not m.departed}
    if holders is not None:
        holders = set(holders)
        if not any(m.worker_id in holders and m.worker_id in waiting for m in staying):
            kept |= {m.worker_id for m in drained if m.worker_id in holders}
    return kept


def decide_round(waiting: Iterable[str], members: Iterable[MemberView],
                 draining: Iterable[str], min_workers: int,
                 round_committed: bool = True,
                 holders: Iterable[str] | None = None) -> RoundDecision:
    """Members waiting on a draining node leave, unless they are the only ones holding the
    job's committed state (`holders`, when the job has committed; `kept_on_drain`). The
    first round forms once every staying member (not leaving, not draining) waits. Later
    ones form once every staying member of an earlier round waits, with the newcomers
    that are already waiting: a newcomer still starting (importing, building its model)
    holds up neither a recovery nor the training of the others, and joins at the round
    after it arrives. Either way at least `min_workers` members. Newcomers are asked over
    only once the last round has committed (`round_committed`): asked sooner, they would
    interrupt that round's first commit, and a recovery would wait for their first groups
    too. A round is not held up by a member of the last round on a draining node still on
    its way to the rendezvous: it is in the round's `departed`, and sent away when it
    arrives, unless no staying member was in the last round: then the last round is all
    on draining nodes and is waited for (it trains on to its next commit). A round that
    kept members on a draining node is asked over once it has committed (`release`): its
    staying members then hold the state. A round all on draining nodes is not: nobody
    would hold the state without them, so they train on in it until their nodes go (asked
    over at each commit, they would form one round per step). A member a driver policy
    asked to leave (`Leave`) counts as one on a draining node throughout."""
    waiting, draining = set(waiting), set(draining)
    members = list(members)
    kept = kept_on_drain(members, draining, holders, waiting)
    leave = sorted(m.worker_id for m in members if m.worker_id in waiting and not m.leaving
                   and m.drains(draining) and m.worker_id not in kept)
    staying = [m for m in members if not m.leaving
               and (not m.drains(draining) or m.worker_id in kept)]
    veterans = {m.worker_id for m in staying if m.in_round}
    arrived = sorted(m.worker_id for m in staying if m.worker_id in waiting)
    must_wait = veterans or {m.worker_id for m in staying}
    form = len(arrived) >= max(1, min_workers) and must_wait <= waiting
    # newcomers at the rendezvous while the others train: those join at their next commit
    interrupt = (round_committed and bool(veterans - waiting)
                 and any(m not in veterans for m in arrived))
    departed = sorted(m.worker_id for m in members if form and m.in_round and not m.leaving
                      and m.drains(draining) and m.worker_id not in waiting
                      and m.worker_id not in kept)
    release = (holders is not None and round_committed and not form
               and any(m.in_round and not m.leaving and m.drains(draining)
                       and m.worker_id not in waiting for m in members)
               and any(m.in_round and not m.leaving and not m.drains(draining)
                       for m in members))
    if form:
        awaits = 0
    elif veterans and not veterans & waiting:
        awaits = 1  # they train on, or none is back yet: any arrival may ask them over
    else:
        awaits = max(1, len(must_wait - waiting), max(1, min_workers) - len(arrived))
    return RoundDecision(leave, form, arrived if form else [], interrupt, departed,
                         sorted(kept & set(arrived)) if form else [], release, awaits)


# Newcomers asked for within this many seconds of each other (one scale-up: a host's slots,
# the nodes the autoscaler brought) are a batch that joins in one round.
TOGETHER_S = 1.0
# How long the first newcomer of a batch that waits at the rendezvous holds the survivors'
# interrupt for the rest of its batch (they train on meanwhile): the most a batch's joining
# adds to the time from a host's arrival to `HostsUpdatedInterrupt`.
JOIN_WINDOW_S = 10.0


def batch_awaited(waiting_asked: Iterable[float], others_asked: Iterable[float],
                  waiting_since: float, now: float,
                  window_s: float = JOIN_WINDOW_S, together_s: float = TOGETHER_S) -> int:
    """How many workers newcomers that wait at the rendezvous (asked for at
    `waiting_asked`) wait on, before the survivors are interrupted (0: none): the rest of
    their batch, workers asked for with them (`others_asked`: starting, or started and not
    at the rendezvous yet, asked within `together_s` of them), for at most `window_s` from
    `waiting_since` (when the first of them waited). One scale-up then costs one reset,
    not one per newcomer (Horovod's `--reset-limit` counts them). A start asked for long
    before (a slow one being hedged) is not of the batch and holds nothing."""
    waiting_asked = list(waiting_asked)
    if not waiting_asked or now - waiting_since >= window_s:
        return 0
    earliest, latest = min(waiting_asked), max(waiting_asked)
    return sum(earliest - together_s <= asked <= latest + together_s
               for asked in others_asked)


def holds_newcomers(waiting_asked: Iterable[float], others_asked: Iterable[float],
                    waiting_since: float, now: float,
                    window_s: float = JOIN_WINDOW_S, together_s: float = TOGETHER_S) -> bool:
    """Whether newcomers that wait at the rendezvous wait on for the rest of their batch
    (`batch_awaited`)."""
    return batch_awaited(waiting_asked, others_asked, waiting_since, now, window_s,
                         together_s) > 0
