"""Liveness: what a failure costs its host (blacklist, reset limit), how long each member
has not answered, which members are lost, stuck or held at the rendezvous."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from raytrain_x.common.errors import (
    FailureLimitExceeded,
    ResetLimitExceeded,
)
from raytrain_x.ray.elastic.blacklist import Blacklist
from raytrain_x.ray.elastic.settings import ElasticSettings


@dataclass(frozen=True)
class FailureVerdict:
    kind: str  # "failure" (host blacklisted) or "lost_draining" (its node went while draining)
    cooldown_s: float = 0.0  # how long the host stays out (inf: for good)


class FailurePolicy:
    """What a failed worker means for its host, and when resets are too many."""

    def __init__(self, settings: ElasticSettings, blacklist: Blacklist) -> None:
        self.settings = settings
        self.blacklist = blacklist
        self.drained_nodes: set[str] = set()  # every node ever seen draining
        self.resets = 0  # rounds after the first, drains aside
        self.failures = 0  # resets that recovered from a failure (Ray Train's count)
        self._failed_since_round = False

    def note_drained(self, node: str) -> None:
        """`node` started draining: a worker lost with it is not its host's failure."""
        self.drained_nodes.add(node)

    def on_failure(self, node: str) -> FailureVerdict:
        """A worker on `node` failed: its host is blacklisted for a cooldown, unless the
        node was draining (it went before the worker's next commit; nothing to blacklist)."""
        if node in self.drained_nodes:
            return FailureVerdict("lost_draining")
        self._failed_since_round = True
        return FailureVerdict("failure", self.blacklist.record_failure(node))

    def count_round(self, is_reset: bool, last_failure: object = None) -> None:
        """A round forms: a reset counts against `reset_limit`, and a reset after failures
        is one failure against `max_failures`; past either the job fails."""
        if not is_reset:
            return
        self.resets += 1
        if self._failed_since_round:
            self._failed_since_round = False
            self.failures += 1
            most = self.settings.max_failures
            if most is not None and most >= 0 and self.failures > most:
                raise FailureLimitExceeded(
                    f"the job's workers failed {self.failures} times, more than "
                    f"max_failures={most}; the last failure: {last_failure or ''}")
        limit = self.settings.reset_limit
        if limit is not None and self.resets > limit:
            raise ResetLimitExceeded(
                f"the job reset {self.resets} times, more than reset_limit={limit}; the last "
                f"failure: {last_failure or ''}")


class Heartbeats:
    """How long each member has not answered the driver.

    The driver asks every member `heartbeat` on its probe thread once a poll, one call out at
    a time each (`WorkerPool.beat`), so it knows who answers before anyone waits for them:
    a member is silent for as long as its oldest unanswered call has been out. A driver
    that stalled does not make members look silent: answers are collected before they are
    judged, and a call answered while the driver was busy counts as answered. A call that
    failed (the process or its node gone, or Ray unable to reach it) leaves the member
    silent from when it went out, and marks it `failed`.

    An answer says how long the member has been in its call to join a round; `joins` keeps
    only joins that began after the member was last given a rank (`assigned`). A join that
    began before ended with that round, though its worker may not have heard it yet: on a
    loaded machine the rounds actor's answer can take seconds to come back, and until it
    does the worker still says it is joining while the actor no longer lists it.

    An answer also says the round of the state the member holds (`state_rounds`): a worker
    that synced the state in a round that never committed, then lost its peers, holds the
    job's state, and the driver learns it from the heartbeat while its join (which says so
    too) may be held back after a partition."""

    def __init__(self) -> None:
        self.out_since: dict[str, float] = {}  # member -> when its unanswered call went out
        self.joining: dict[str, float] = {}  # member -> its last answer (s in its join)
        self.join_began: dict[str, float] = {}  # member -> earliest its join can have begun
        self.assigned_at: dict[str, float] = {}  # member -> when it was last given a rank
        self.state_rounds: dict[str, int] = {}  # member -> the round of the state it holds
        # member -> (its median work per step in its world, over how many steps)
        self.work: dict[str, tuple[float, int]] = {}
        self.failed: set[str] = set()  # members whose last call failed

    def record(self, answers: Mapping[str, tuple], failed: Iterable[str],
               sent: Iterable[str], now: float) -> None:
        """One round of the heartbeat (`WorkerPool.beat`): the answers collected (seconds in
        a join, the round of the state held, and the work per step with its count of
        steps), the calls that failed, the members a call went out to at `now`."""
        for worker_id, (joining_s, state_round, *work) in answers.items():
            self.answered(worker_id, joining_s, self.out_since.get(worker_id), state_round)
            if work:
                self.work[worker_id] = (work[0], work[1])
        for worker_id in failed:
            self.call_failed(worker_id)
        for worker_id in sent:
            self.sent(worker_id, now)

    def sent(self, worker_id: str, now: float) -> None:
        """A call went out to `worker_id` (the first unanswered one starts its silence)."""
        self.out_since.setdefault(worker_id, now)

    def answered(self, worker_id: str, joining_s: float, sent_at: float | None = None,
                 state_round: int = 0) -> None:
        """`worker_id` answered the call that went out at `sent_at` (None: unknown): in its
        join for `joining_s`, which began no earlier than `sent_at - joining_s`, holding the
        state of round `state_round` (0: none)."""
        self.out_since.pop(worker_id, None)
        self.state_rounds[worker_id] = state_round
        self.failed.discard(worker_id)
        self.joining[worker_id] = joining_s
        self.join_began[worker_id] = -math.inf if sent_at is None else sent_at - joining_s

    def assigned(self, worker_ids: Iterable[str], now: float) -> None:
        """These members were given a rank in a round published at `now` (the work they
        reported was their last world's)."""
        for worker_id in worker_ids:
            self.assigned_at[worker_id] = now
            self.work.pop(worker_id, None)

    def joins(self) -> dict[str, float]:
        """Seconds each member was in its call to join at its last answer, for the joins
        that surely began after it was last given a rank (a member never given one: any)."""
        return {w: s for w, s in self.joining.items() if s > 0
                and self.join_began.get(w, -math.inf) > self.assigned_at.get(w, -math.inf)}

    def call_failed(self, worker_id: str) -> None:
        self.failed.add(worker_id)

    def silent_for(self, worker_id: str, now: float) -> float:
        since = self.out_since.get(worker_id)
        return 0.0 if since is None else now - since

    def keep(self, worker_ids: Iterable[str]) -> None:
        """Forgets members no longer in the job."""
        keep = set(worker_ids)
        for table in (self.out_since, self.joining, self.join_began, self.assigned_at,
                      self.state_rounds, self.work):
            for worker_id in set(table) - keep:
                del table[worker_id]
        self.failed &= keep


class Stragglers(NamedTuple):
    """What one look at the rendezvous decides (`StragglerRule.observe`)."""

    needs_round: bool
    lost: list[str]  # absent and silent (or their last call failed): they fail as lost
    stuck: list[str]  # absent too long though they answer: they fail as stuck
    absent: list[str]  # every member absent while its peers wait


class StragglerRule:
    """Workers whose peers wait at the rendezvous without them.

    A member waiting at the rendezvous left its round (it lost a peer), so a round is
    needed, even when none is absent: every member of a round that failed for all of them
    at once (their rendezvous or first collective timing out together) arrives within one
    poll, and no other event would form the next round.

    A worker on a host cut off by a partition is alive to Ray (until Ray's health checks
    give up on the node, about a minute by default) while its peers lost it at their last
    collective, and would hold the next round forever. An absent member that has not
    answered the driver's heartbeat for `lost_after_s` (`Heartbeats`), or whose last call
    failed, fails like a dead worker: the heartbeat went out before its peers left their
    collective, so a host cut off since then is failed at the first poll after they wait,
    not a probe's wait later. One that answers but stays away `stuck_after_s` (the
    collective timeout and a grace: longer than a healthy worker takes to fail its own
    collective and restore) is stuck and fails too: after a partition, Ray holds a worker's
    calls to an actor it lost touch with for a minute or more (its client's reconnect
    backoff), and a rendezvous `join` held that way never arrives (`held_joins` catches
    that sooner). Only members that were in a round can be stuck; a newcomer still
    starting is not. Silence alone fails no one: a host cut off for less than the
    collective timeout is back before its peers leave their collective. Nor does a
    newcomer's (a member never given a rank): no peer left a collective for it, and one
    loading its framework is silent for seconds on a loaded node (`import torch` holds
    Python's interpreter lock through its libraries' loading, and the heartbeat's thread
    waits for it: 11-15 s measured with three busy processes on two cores). A newcomer
    fails when Ray reports its process or node gone (its call fails); a round with
    members of an earlier round does not wait for it anyway (`decide_round`)."""

    def __init__(self, lost_after_s: float = math.inf, stuck_after_s: float = math.inf) -> None:
        self.lost_after_s = lost_after_s
        self.stuck_after_s = stuck_after_s
        self.absent_since: dict[str, float] = {}  # absent worker -> first seen absent

    def observe(self, waiting: Iterable[str], present: Iterable[str], now: float,
                in_round: Iterable[str] = (), silent: Mapping[str, float] | None = None,
                failed: Iterable[str] = ()) -> Stragglers:
        """`silent`: seconds each member has not answered (`Heartbeats.silent_for`);
        `failed`: members whose last heartbeat failed."""
        waiting, present = set(waiting), set(present)
        absent = sorted(present - waiting)
        if not absent or not waiting & present:
            self.absent_since = {}
            return Stragglers(bool(waiting & present), [], [], [])
        self.absent_since = {w: self.absent_since.get(w, now) for w in absent}
        silent, failed = silent or {}, set(failed)
        veterans = set(in_round)
        lost = [w for w in absent if w in failed
                or (w in veterans and silent.get(w, 0.0) >= self.lost_after_s)]
        stuck = [w for w in absent if w not in lost and w in veterans
                 and now - self.absent_since[w] >= self.stuck_after_s]
        return Stragglers(True, lost, stuck, absent)

    def forget(self, worker_ids: Iterable[str]) -> None:
        """These members were given a rank in a new round: an absence seen before counts
        no more (a worker whose answer from the rounds actor comes back late is absent from
        the rendezvous until it does, and was not away from the round it was placed in)."""
        for worker_id in worker_ids:
            self.absent_since.pop(worker_id, None)


def spare_last_holders(candidates: Iterable[str], members: Iterable[str],
                       holders: Iterable[str] | None) -> list[str]:
    """The `candidates` (members that answer but stay away: held joins, stuck) to restart,
    less those that hold the job's state when no other of the `members` (those known to
    be there: answering the heartbeat) does: restarted, they would take the state with
    them and the job would stop with `ElasticStateLost`; waited for, a held call arrives
    (Ray's reconnect backoff reaches a minute or more) and a stuck one reaches its own
    timeout. `holders` None: the job has not committed."""
    candidates = list(candidates)
    if holders is None:
        return candidates
    holders = set(holders)
    if (holders & set(members)) - set(candidates):
        return candidates
    return [w for w in candidates if w not in holders]


def held_joins(joining: Mapping[str, float], waiting: Iterable[str],
               held_after_s: float) -> list[str]:
    """Workers that say they have been in their call to join a round for `held_after_s`
    or more while the rounds actor has not received it (`waiting`): Ray holds that call
    back (after a network partition, its client to the actor can wait a minute or more
    to reconnect), and it will not arrive in time."""
    waiting = set(waiting)
    return sorted(w for w, seconds in joining.items()
                  if seconds >= held_after_s and w not in waiting)
