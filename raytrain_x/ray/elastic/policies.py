"""The elastic job's decisions, as pure policies (no Ray: an import-linter contract says
so). Each takes a snapshot of what the controller saw and, where time matters, the clock's
reading, and returns what to do; the controller (`controller.py`) carries it out.
`tests/unit/test_elastic_policies.py` checks every decision with a fake clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from raytrain_x.common.errors import (
    ConfigError,
    ElasticStateLost,
    ElasticTimeout,
    ResetLimitExceeded,
)
from raytrain_x.common.settings import short_node
from raytrain_x.elastic.blacklist import Blacklist
from raytrain_x.elastic.discovery import slots_from_resources
from raytrain_x.ray.elastic.settings import ElasticSettings


def shape(resources: Mapping[str, float]) -> str:
    """Resources as a user reads them: `{CPU: 1, GPU: 1}`."""
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())
                           if v and not k.startswith("node:")
                           and k not in ("memory", "object_store_memory")) + "}"


# ----------------------------------------------------------------------------- scaling
@dataclass(frozen=True)
class PendingView:
    """A worker asked for and not answering yet."""

    key: object
    node: str
    asked_at: float


class ScalingPolicy:
    """How many workers to start and where, what to ask the autoscaler for, and when a
    worker that is starting is given up on."""

    def __init__(self, settings: ElasticSettings) -> None:
        self.settings = settings
        self.per_worker = settings.per_worker

    def usable_slots(self, free: Mapping[str, int], draining: Iterable[str],
                     blacklist: Blacklist) -> dict[str, int]:
        """The free worker slots the job may use: not on a draining or blacklisted host."""
        draining = set(draining)
        return {h: n for h, n in free.items() if n > 0 and h not in draining
                and not blacklist.is_blacklisted(h)}

    def starts(self, usable: Mapping[str, int], members: int, pending: int,
               last_resort: Iterable[str] = ()) -> list[str]:
        """The nodes to start workers on (one entry per worker), up to `max_workers`
        counting those running and starting; nodes in id order, each filled in turn, the
        `last_resort` ones (a worker lately did not start there) after every other: a node
        that cannot start workers would otherwise take every start while others idle."""
        room = self.settings.max_workers - members - pending
        if room <= 0:
            return []
        last = set(last_resort)
        order = sorted(usable.items(), key=lambda item: (item[0] in last, item[0]))
        return [node for node, slots in order for _ in range(slots)][:room]

    def bundles(self, staying: int, pending: int, unusable_slots: int) -> int:
        """How many worker bundles to ask the autoscaler for: room for `max_workers` while
        the job has fewer (running or starting), 0 once it has them. Ray counts the
        capacity of blacklisted and draining nodes too, so their slots are asked for on
        top, or the autoscaler would add nothing in their place."""
        if self.settings.max_workers - staying - pending <= 0:
            return 0
        return self.settings.max_workers + max(0, unusable_slots)

    def give_ups(self, pending: Iterable[PendingView],
                 node_totals: Mapping[str, Mapping[str, float]],
                 now: float) -> list[tuple[object, str]]:
        """The starting workers to give up on, with why: their node left, it can no longer
        fit a worker even when empty, or they did not start within `start_timeout_s`. A
        worker that is merely slow is waited for: Ray cannot tell a slow start (a
        runtime_env being set up holds the slot with no process yet) from an unplaceable
        one."""
        out = []
        for p in pending:
            if p.node not in node_totals:
                out.append((p.key, "its node left the cluster"))
            elif slots_from_resources(node_totals[p.node], self.per_worker) < 1:
                out.append((p.key, "its node can no longer fit a worker"))
            elif now - p.asked_at > self.settings.start_timeout_s:
                out.append((p.key, f"it did not start within start_timeout_s="
                                   f"{self.settings.start_timeout_s:g}s"))
        return out

    def check_feasible(self, nodes: Mapping[str, Mapping[str, float]],
                       node_types: Mapping[str, Mapping[str, float]] | None) -> None:
        """A `ConfigError` when no node, and no node type the autoscaler publishes, can fit
        one worker (an autoscaler that publishes none may still have one)."""
        if any(slots_from_resources(res, self.per_worker) >= 1 for res in nodes.values()):
            return
        if node_types is None or any(slots_from_resources(res, self.per_worker) >= 1
                                     for res in node_types.values()):
            return
        offered = sorted({shape(res) for res in [*nodes.values(), *node_types.values()]})
        raise ConfigError(
            f"a worker needs {shape(self.per_worker)}, which no node of this cluster and no "
            f"node type of its autoscaler offers (they offer: {'; '.join(offered)}). Lower "
            "cpus_per_worker/gpus_per_worker/resources_per_worker, or add a node type that "
            "has them to the cluster config.")


# ----------------------------------------------------------------------------- drains
@dataclass
class DrainNotice:
    """What a change in the draining nodes asks for."""

    new: dict[str, float] = field(default_factory=dict)  # node -> deadline (time.time())
    give_up: list[object] = field(default_factory=list)  # starting workers on them
    leaving: dict[str, int] = field(default_factory=dict)  # node -> members that leave

    @property
    def interrupt(self) -> bool:
        """Whether members must leave (every rank is interrupted at its next commit)."""
        return bool(self.leaving)


def notice_drains(draining: Mapping[str, float], known: Iterable[str],
                  pending: Iterable[PendingView], member_nodes: Iterable[str]) -> DrainNotice:
    """The nodes that started draining since `known`, the starting workers on them (given
    up) and how many members each has (they leave at the next commit, without a restore or
    a blacklist)."""
    known = set(known)
    notice = DrainNotice(new={n: d for n, d in sorted(draining.items()) if n not in known})
    members = list(member_nodes)
    for node in notice.new:
        notice.give_up += [p.key for p in pending if p.node == node]
        count = members.count(node)
        if count:
            notice.leaving[node] = count
    return notice


def abandons_forming_round(notice: DrainNotice, in_round: Iterable[str], round_id: int,
                           committed_round: int) -> bool:
    """Whether a drain gives up the round now forming: a member of that round (`in_round`:
    the nodes of its ranks) is on a newly draining node, and the round has not committed
    yet (`committed_round` < `round_id`: its rendezvous or state sync is under way). Such a
    member could only leave at the round's first commit, after the round formed in full,
    and then every rank would meet once more; the round's peers are answered at once
    instead and form the next round without it."""
    return round_id > committed_round and bool(set(notice.leaving) & set(in_round))


def held_back(held: Iterable[str], members: Iterable[MemberView], draining: Iterable[str],
              min_workers: int, responsive: Iterable[str],
              holders: Iterable[str] | None) -> set[str]:
    """The newcomers of a given-up round (`held`) that the next round forms without: the
    others recover first, and they are restarted (the one that made the given-up round
    slow would make the next one as slow). None when the members in a round that stay
    and are known to be there (`responsive`: they answered the last heartbeat) are too
    few for a round on their own (the first round, fewer than `min_workers`, or peers
    gone unseen): then everyone waits for them as before. A newcomer that synced the
    job's state (one of `holders`) is never restarted: it arrived, and it may be the
    state's last copy when a veteran's node is gone unseen."""
    held, draining, responsive = set(held), set(draining), set(responsive)
    veterans = [m for m in members if m.in_round and not m.leaving and m.node not in draining
                and m.worker_id not in held and m.worker_id in responsive]
    if len(veterans) < max(1, min_workers):
        return set()
    return held - set(holders or ())


def drain_line(node: str, deadline: float, now: float, workers: int) -> str:
    """The progress line of a node that started draining."""
    left_s = deadline - now
    when = "no deadline" if math.isinf(left_s) else f"deadline in {left_s:.0f} s"
    return (f"node {short_node(node)} is draining ({when}); its {workers} worker(s) leave the "
            "job at the next commit")


# ----------------------------------------------------------------------------- minimum
class MinimumWatch:
    """`min_workers` over time: fewer staying workers than that are waited for up to
    `elastic_timeout`, then the job fails (`elastic_timeout_error`)."""

    def __init__(self, settings: ElasticSettings) -> None:
        self.settings = settings
        self.below_since: float | None = None

    def observe(self, staying: int, now: float) -> str:
        """'ok'; 'below' at the first poll below the minimum (warn once); 'waiting' after;
        'timeout' once below for longer than `elastic_timeout`."""
        if staying >= self.settings.min_workers:
            self.below_since = None
            return "ok"
        if self.below_since is None:
            self.below_since = now
            return "below"
        return "timeout" if now - self.below_since > self.settings.elastic_timeout \
            else "waiting"


def elastic_timeout_error(settings: ElasticSettings, staying: int, starting: int,
                          bundles: int, blacklisted: list[str]) -> ElasticTimeout:
    """The error of a job that stayed below `min_workers` past `elastic_timeout`, with
    what it was waiting for and what to change."""
    waiting = f" ({starting} still starting)" if starting else ""
    asked = (f"; asked the autoscaler for room for {bundles} workers of "
             f"{shape(settings.per_worker)} and none came") if bundles else ""
    return ElasticTimeout(
        f"only {staying} workers{waiting} for {settings.elastic_timeout:.0f}s, fewer than "
        f"min_workers={settings.min_workers}{asked}; blacklisted hosts: "
        f"{[short_node(h) for h in blacklisted]}. Add capacity (or node types that fit a "
        "worker), "
        "lower min_workers or raise elastic_timeout.")


# ----------------------------------------------------------------------------- failures
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

    def on_failure(self, node: str) -> FailureVerdict:
        """A worker on `node` failed: its host is blacklisted for a cooldown, unless the
        node was draining (it went before the worker's next commit; nothing to blacklist)."""
        if node in self.drained_nodes:
            return FailureVerdict("lost_draining")
        return FailureVerdict("failure", self.blacklist.record_failure(node))

    def count_round(self, is_reset: bool, last_failure: object = None) -> None:
        """A round forms: a reset counts against `reset_limit`; past it the job fails."""
        if not is_reset:
            return
        self.resets += 1
        limit = self.settings.reset_limit
        if limit is not None and self.resets > limit:
            raise ResetLimitExceeded(
                f"the job reset {self.resets} times, more than reset_limit={limit}; the last "
                f"failure: {last_failure or ''}")


class Heartbeats:
    """How long each member has not answered the driver.

    The driver asks every member `joining` on its probe thread once a poll, one call out at
    a time each (`WorkerPool.beat`), so it knows who answers before anyone waits for them:
    a member is silent for as long as its oldest unanswered call has been out. A driver
    that stalled does not make members look silent: answers are collected before they are
    judged, and a call answered while the driver was busy counts as answered. A call that
    failed (the process or its node gone, or Ray unable to reach it) leaves the member
    silent from when it went out, and marks it `failed`."""

    def __init__(self) -> None:
        self.out_since: dict[str, float] = {}  # member -> when its unanswered call went out
        self.joining: dict[str, float] = {}  # member -> its last answer (s in its join)
        self.failed: set[str] = set()  # members whose last call failed

    def record(self, answers: Mapping[str, float], failed: Iterable[str],
               sent: Iterable[str], now: float) -> None:
        """One round of the heartbeat (`WorkerPool.beat`): the answers collected, the calls
        that failed, the members a call went out to at `now`."""
        for worker_id, joining_s in answers.items():
            self.answered(worker_id, joining_s)
        for worker_id in failed:
            self.call_failed(worker_id)
        for worker_id in sent:
            self.sent(worker_id, now)

    def sent(self, worker_id: str, now: float) -> None:
        """A call went out to `worker_id` (the first unanswered one starts its silence)."""
        self.out_since.setdefault(worker_id, now)

    def answered(self, worker_id: str, joining_s: float) -> None:
        self.out_since.pop(worker_id, None)
        self.failed.discard(worker_id)
        self.joining[worker_id] = joining_s

    def call_failed(self, worker_id: str) -> None:
        self.failed.add(worker_id)

    def silent_for(self, worker_id: str, now: float) -> float:
        since = self.out_since.get(worker_id)
        return 0.0 if since is None else now - since

    def keep(self, worker_ids: Iterable[str]) -> None:
        """Forgets members no longer in the job."""
        keep = set(worker_ids)
        for table in (self.out_since, self.joining):
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
    collective timeout is back before its peers leave their collective."""

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
        lost = [w for w in absent if w in failed or silent.get(w, 0.0) >= self.lost_after_s]
        veterans = set(in_round)
        stuck = [w for w in absent if w not in lost and w in veterans
                 and now - self.absent_since[w] >= self.stuck_after_s]
        return Stragglers(True, lost, stuck, absent)


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


# ----------------------------------------------------------------------------- rounds
@dataclass(frozen=True)
class MemberView:
    worker_id: str
    node: str
    leaving: bool = False
    in_round: bool = False  # it was given a place in a round (not a newcomer still starting)
    # its node drains and a round formed without it: its state is behind that round's
    departed: bool = False


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
        f"workers failed in all; the last: {_first_line(last_failure)}). A new round "
        "would start over from the initial state, so the job stops instead. Restart it "
        "(from a checkpoint, if it saves one); with faults this frequent, run more "
        "workers or a higher min_workers so that one of them survives.")


def _first_line(value: object) -> str:
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
    staying = [m for m in members if m.node not in draining]
    drained = [m for m in members if m.node in draining]
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
    staying members then hold the state."""
    waiting, draining = set(waiting), set(draining)
    members = list(members)
    kept = kept_on_drain(members, draining, holders, waiting)
    leave = sorted(m.worker_id for m in members if m.worker_id in waiting and not m.leaving
                   and m.node in draining and m.worker_id not in kept)
    staying = [m for m in members if not m.leaving
               and (m.node not in draining or m.worker_id in kept)]
    veterans = {m.worker_id for m in staying if m.in_round}
    arrived = sorted(m.worker_id for m in staying if m.worker_id in waiting)
    must_wait = veterans or {m.worker_id for m in staying}
    form = len(arrived) >= max(1, min_workers) and must_wait <= waiting
    # newcomers at the rendezvous while the others train: those join at their next commit
    interrupt = (round_committed and bool(veterans - waiting)
                 and any(m not in veterans for m in arrived))
    departed = sorted(m.worker_id for m in members if form and m.in_round and not m.leaving
                      and m.node in draining and m.worker_id not in waiting
                      and m.worker_id not in kept)
    release = (holders is not None and round_committed and not form
               and any(m.in_round and not m.leaving and m.node in draining
                       and m.worker_id not in waiting for m in members))
    return RoundDecision(leave, form, arrived if form else [], interrupt, departed,
                         sorted(kept & set(arrived)) if form else [], release)
