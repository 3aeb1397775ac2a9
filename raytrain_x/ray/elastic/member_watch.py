"""The elastic job's members: their outcomes and failures, their heartbeats, and which
of them are lost, stuck or held at the rendezvous; and which hold the job's state."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from raytrain_x.comm.groups import round_prefix
from raytrain_x.common.errors import ElasticStateLost, StorageError, WorkerError
from raytrain_x.common.settings import JOIN_HELD_S, SILENT_LOST_S, STUCK_GRACE_S, short_node
from raytrain_x.ray.elastic.context import JobContext
from raytrain_x.ray.elastic.policies import (
    Change,
    FailurePolicy,
    Heartbeats,
    PeersWaiting,
    StragglerRule,
    WorkerFailed,
    held_joins,
    spare_last_holders,
    state_lost_error,
)
from raytrain_x.ray.elastic.pool import Member
from raytrain_x.ray.elastic.rounds import current_holders
from raytrain_x.ray.elastic.settings import STRAGGLER_POLL_S
from raytrain_x.ray.failures import held_join_error, stuck_error, unreachable_error

log = logging.getLogger("raytrain_x.elastic")


class Polled(NamedTuple):
    """What one poll of the members found."""

    finished: dict[str, Any]  # worker id -> the result of a member that finished
    changes: list[Change]  # members failed: their round forms again without them


class MemberWatch:
    """Polls the members and carries out what `FailurePolicy` and `StragglerRule` decide."""

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        self.failures = FailurePolicy(ctx.settings, ctx.blacklist)
        self.stragglers = StragglerRule(lost_after_s=SILENT_LOST_S,
                                        stuck_after_s=ctx.settings.timeout_s + STUCK_GRACE_S)
        self.heartbeats = Heartbeats()

    def poll(self) -> Polled:
        """Waits briefly for outcomes; handles failures and departures; returns the
        results of members that finished, and the failures a round must answer."""
        ctx = self.ctx
        if not any(m.ref is not None for m in ctx.members.values()):
            ctx.parts.sleep(0.1)
            return Polled({}, [])
        outcomes = ctx.pool.poll(timeout_s=0.1)
        changes: list[Change] = []
        for member, error in outcomes.failed:
            changes += self.on_failure(member, error)
        for member, left in outcomes.left:
            ctx.pool.remove(member)
            ctx.log.add("left", member.node)
            log.info("raytrain-x elastic: worker %s left the job (%s)", member.worker_id,
                     left.reason)
        return Polled(outcomes.finished, changes)

    def on_failure(self, member: Member, error: WorkerError) -> list[Change]:
        """Takes a member's failure in; returns it as the change its round must answer by
        forming again without it (none for a member that had left the job's rounds)."""
        ctx = self.ctx
        if member.leaving or member.departed:
            # it had left the job's rounds (its node drains): no round waits for it
            ctx.pool.remove(member)
            ctx.log.add("left", member.node, lost=True)
            log.info("raytrain-x elastic: worker %s, which had left the job, was lost with its "
                     "draining node", member.worker_id)
            return []
        if error.state_lost is not None:
            # it found part of the committed state gone with every copy (a sharded
            # optimizer's shard): every member of its round finds the same, and another
            # round would find no more
            raise ElasticStateLost(f"rank {member.rank}: {error.state_lost}")
        # peers still forming this round with it would wait for its keys until their
        # timeout: they are answered at once and join the next round
        ctx.store.abandon(round_prefix(ctx.rounds))
        ctx.pool.remove(member)
        ctx.log.note("failure", failed=1)
        ctx.last_failure = error
        verdict = self.failures.on_failure(member.node)
        if verdict.kind == "lost_draining":
            ctx.log.add("lost_draining", member.node)
            log.warning("raytrain-x elastic: worker %s (%s) was lost with its draining "
                        "node %s before its next commit; the others restore the last commit",
                        member.worker_id, _which(member.rank), short_node(member.node))
        else:
            ctx.log.add("failure", member.node, cooldown_s=verdict.cooldown_s,
                        cause=error.cause)
            log.warning("raytrain-x elastic: worker %s (%s) on node %s failed (%s); "
                        "host blacklisted for %s", member.worker_id, _which(member.rank),
                        short_node(member.node), _last_line(error.detail),
                        "good" if verdict.cooldown_s == float("inf")
                        else f"{verdict.cooldown_s:.1f}s")
        return [WorkerFailed(member.worker_id, member.node, member.rank, str(error.cause),
                             lost_draining=verdict.kind == "lost_draining")]

    def check_all_failed(self) -> None:
        """No worker is left, the last one having failed. A function that raised fails the
        job with its error, as does any failure when hosts are blacklisted for good. Lost
        processes (killed, crashed, cut off) with a cooldown are waited out like a start
        (`min_workers`, `elastic_timeout`), unless the job had committed: its state went
        with them."""
        failure = self.ctx.last_failure
        if not failure.process_lost or self.ctx.settings.cooldown_range is None:
            raise failure
        if not self.ctx.rounds_client.committed():
            return
        try:
            floor = self.durable_floor()
        except StorageError:  # the round that restores waits for storage (round_forming)
            return
        if floor is None:
            raise state_lost_error(failure, self.lost_workers())

    def durable_floor(self) -> dict | None:
        """The durable checkpoint a round with no holder of the state restores (None: the
        job has no `CheckpointConfig`, or no checkpoint of it is complete yet: the state
        is lost)."""
        if self.ctx.settings.checkpoint is None:
            return None
        latest = self.ctx.parts.latest_checkpoint()
        return latest if latest.get("number") is not None else None

    def lost_workers(self) -> int:
        log_ = self.ctx.log
        return len(log_.of("failure")) + len(log_.of("lost_draining"))

    def check_stragglers(self) -> list[Change]:
        """Looks at who is absent from the rendezvous (`StragglerRule`) and fails the lost,
        held and stuck; returns what the next round must answer of what it found: their
        failures, or members waiting at the rendezvous for a round."""
        ctx = self.ctx
        beats, now = self.heartbeats, ctx.clock()
        beats.record(*ctx.pool.beat(), now)
        beats.keep(ctx.members)
        waiting = ctx.rounds_client.waiting()
        present = self.present()
        verdict = self.stragglers.observe(
            waiting, present, now, [w for w in present if ctx.members[w].rank >= 0],
            silent={w: beats.silent_for(w, now) for w in present}, failed=beats.failed)
        changes: list[Change] = []
        if verdict.lost:
            addresses = ctx.cluster.addresses()
            changes += self.fail_all(verdict.lost, lambda ranks, nodes: unreachable_error(
                ranks, nodes, "while their peers waited for them at the rendezvous",
                addresses))
        # absent ones that answer: in a join the rounds actor never received? (asked
        # again: one may have arrived since the first look)
        joins = beats.joins()
        answering = {w: joins[w] for w in verdict.absent if w in joins and w not in verdict.lost}
        if answering:
            held = held_joins(answering, ctx.rounds_client.waiting(), JOIN_HELD_S)
            held = self.spare_last_holders(held)
            if held:
                changes += self.fail_all(held, held_join_error)
        stuck = self.spare_last_holders(verdict.stuck)
        if stuck:
            where = ctx.pool.ask(stuck, "where")
            changes += self.fail_all(stuck, lambda ranks, nodes: stuck_error(
                ranks, nodes, self.stragglers.stuck_after_s,
                {ctx.members[w].rank: at for w, at in where.items()}))
        if verdict.needs_round and not changes:
            changes.append(PeersWaiting(len(set(waiting) & set(present))))
        return changes

    def spare_last_holders(self, candidates: list[str]) -> list[str]:
        """`spare_last_holders` of the members about to be restarted, the other holders
        of the state asked first (a ping): one whose node went since the last heartbeat
        answered does not count, and the candidates are then the last holders."""
        if not candidates:
            return candidates
        holders = self.holders()
        if holders is None:
            return candidates
        others = set(holders) & set(self.responsive()) - set(candidates)
        there = self.ctx.pool.ask(others, "ping") if others else {}
        return spare_last_holders(candidates, there, holders)

    def responsive(self) -> list[str]:
        """The members known to be there: they answered the heartbeat's last call (one
        goes out each poll; one whose process or node is gone unseen answers nothing)."""
        beats, now = self.heartbeats, self.ctx.clock()
        return [w for w in self.ctx.members if w not in beats.failed
                and beats.silent_for(w, now) < 2 * STRAGGLER_POLL_S]

    def holders(self, committed_round: int | None = None) -> list[str] | None:
        """The members that hold the job's latest committed state (None: it never
        committed; one that left or died holds nothing the job can reach): those that said
        so when they last joined a round, the members of the round that committed last
        (they report it only at their next join), and those whose last heartbeat says so
        (a join Ray holds back after a partition never says it)."""
        ctx = self.ctx
        if committed_round is None:
            committed_round = ctx.rounds_client.committed_round()
        if not committed_round:
            return None
        members = set(ctx.members)
        holders = set(ctx.rounds_client.holders()) & members  # one gone holds nothing
        holders |= ctx.round_members.get(committed_round, set()) & members
        holders |= set(current_holders(self.heartbeats.state_rounds, committed_round)) & members
        return sorted(holders)

    def present(self) -> list[str]:
        """The members whose peers may wait for them at the rendezvous. A drained member
        that a round formed without is not one: it is sent away when it arrives, and its
        wait is not a peer waiting for the others (counted as one, it made the members
        training in that round look stuck)."""
        return [w for w, m in self.ctx.members.items() if not m.leaving and not m.departed]

    def fail_all(self, worker_ids: Iterable[str], errors_of: Callable) -> list[Change]:
        """Fails these members with one error naming them all: `errors_of(ranks, nodes)`;
        returns their failures (a round forms again without them)."""
        members = [self.ctx.members[w] for w in worker_ids if w in self.ctx.members]
        if not members:
            return []
        errors = errors_of(sorted(m.rank for m in members), [m.node for m in members])
        changes: list[Change] = []
        for member in members:
            changes += self.on_failure(member, errors[member.rank])
        return changes


def _last_line(text: str) -> str:
    """The line of a traceback that names the error."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else "no detail"


def _which(rank: int) -> str:
    """A member's rank for a message: none before its first round."""
    return f"rank {rank}" if rank >= 0 else "before its first round"
