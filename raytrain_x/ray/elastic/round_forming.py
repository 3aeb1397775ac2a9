"""Forming the elastic job's next round: who leaves at the rendezvous, who departs with
their draining node, who stays and with which rank, and whether the job's state survives."""

from __future__ import annotations

import logging

from raytrain_x.comm.groups import round_prefix
from raytrain_x.common.errors import StorageError
from raytrain_x.common.logs import progress_logger
from raytrain_x.common.settings import STORAGE_POLL_S, short_node
from raytrain_x.ray.elastic.context import JobContext
from raytrain_x.ray.elastic.drain_watch import note_left
from raytrain_x.ray.elastic.history import round_line
from raytrain_x.ray.elastic.member_watch import MemberWatch
from raytrain_x.ray.elastic.policies import (
    batch_awaited,
    decide_round,
    state_lost,
    state_lost_error,
)
from raytrain_x.ray.elastic.rounds import plan_round

log = logging.getLogger("raytrain_x.elastic")

# the rounds whose store keys are kept: a round's are deleted once the second after it forms
ROUNDS_KEPT = 2
progress = progress_logger("raytrain_x.elastic.progress")


class RoundForming:
    """Carries out what `decide_round` decides and publishes the round `plan_round` plans."""

    def __init__(self, ctx: JobContext, members: MemberWatch) -> None:
        self.ctx = ctx
        self.members = members
        self._asked_over = False  # the round's members were asked to a round for newcomers
        self._storage_down_since: float | None = None  # a round waits for storage since
        self._storage_next_ask = 0.0
        self._newcomers_since: float | None = None  # a newcomer waits to join since

    def step(self, needs_round: bool) -> bool:
        """Sends drained members away and forms a round when one is needed (`needs_round`:
        a change the next round must take in) and ready. Returns whether a round is still
        needed after this look."""
        ctx = self.ctx
        # a drained member the last round formed without is sent away when it arrives
        departing = any(m.departed and not m.leaving for m in ctx.members.values())
        if not needs_round and not departing:
            return False
        waiting = ctx.rounds_client.waiting()
        committed_round = ctx.rounds_client.committed_round()
        for old in [r for r in ctx.round_members if r < committed_round]:
            del ctx.round_members[old]  # a later round committed: they are not needed
        holders = self.members.holders(committed_round)
        decision = decide_round(waiting, [m.view() for m in ctx.members.values()],
                                ctx.draining, ctx.settings.min_workers,
                                committed_round >= ctx.rounds, holders)
        if decision.leave:  # they return from `execute` with `Left`; the poll drops them
            ctx.rounds_client.publish({w: {"leave": True, "reason": _leave_reason(ctx, w)}
                                       for w in decision.leave})
            leaving = [ctx.members[w] for w in decision.leave]
            note_left(ctx, leaving)
            for member in leaving:
                member.leaving = True
        if not needs_round:
            return False
        if decision.interrupt and not decision.release and not decision.leave:
            batch = self._batch_awaited(waiting)
            if batch:  # the survivors train on meanwhile
                return self._await_joins(len(waiting) + batch)
        if (decision.interrupt or decision.release) and not self._asked_over:
            self._asked_over = True
            ctx.rounds_client.bump_hosts()
            if decision.interrupt:
                ctx.log.add("scale_up")
        if not decision.form:  # survivors are on their way to it
            return self._await_joins(len(waiting) + decision.awaits)
        departed = [ctx.members[w] for w in decision.departed]
        note_left(ctx, departed)  # the round forms without them: they left with it
        for member in departed:
            member.departed = True
        return self._form({w: ctx.members[w] for w in decision.ranks}, kept=len(decision.kept))

    def _await_joins(self, at_least: int) -> bool:
        """The round waits for workers to join: the driver's poll ends as `at_least` wait
        (`RoundsClient.watch_joins`: the joins the decision waits for, not each join of a
        large round), and the round forms then, not at the next look. Returns that a round
        is still needed."""
        self.ctx.rounds_client.watch_joins(at_least, self.ctx.pool.wake)
        return True

    def _batch_awaited(self, waiting: list[str]) -> int:
        """Newcomers wait at the rendezvous: how many workers started with them they wait
        on (`batch_awaited`; 0: none), so that a batch joins in one round."""
        ctx = self.ctx
        waiting = set(waiting)
        newcomers = [m for m in ctx.members.values() if m.rank < 0 and not m.leaving]
        arrived = [m.asked_at for m in newcomers if m.worker_id in waiting]
        if not arrived:
            self._newcomers_since = None
            return 0
        now = ctx.clock()
        if self._newcomers_since is None:
            self._newcomers_since = now
        others = [m.asked_at for m in newcomers if m.worker_id not in waiting]
        others += [p.asked_at for p in ctx.pending.values()
                   if p.node not in ctx.draining]
        return batch_awaited(arrived, others, self._newcomers_since, now)

    def _restores(self, staying: dict, holders: list[str] | None) -> dict | None:
        """The checkpoint the round restores (None: none; it keeps what its members hold):
        the latest complete one when no member holds the committed state, or, for a job
        that never committed, when it is run again (after its driver or its control actors
        died).

        Raises:
            ElasticStateLost: no member holds the state and there is no checkpoint.
            StorageError: storage could not be listed, after retries.
        """
        if holders is not None and state_lost(staying, holders, committed=True):
            checkpoint = self.members.durable_floor()
            if checkpoint is None:
                raise state_lost_error(self.ctx.last_failure, self.members.lost_workers())
            return checkpoint
        return self.members.durable_floor() if holders is None else None

    def _wait_for_storage(self, exc: StorageError) -> bool:
        """A round that may restore from storage while storage does not answer waits for
        it, as long as `elastic_timeout`, rather than start over or fail at once (an object
        store's outage, a remounting NFS). Returns that a round is still needed.

        Raises:
            StorageError: storage has not answered for `elastic_timeout`.
        """
        ctx = self.ctx
        now = ctx.clock()
        self._storage_next_ask = now + STORAGE_POLL_S
        if self._storage_down_since is None:
            self._storage_down_since = now
            progress.warning("raytrain-x elastic: %s; the next round waits for storage (at "
                             "most %.0f s): it may have to restore the job's state from it",
                             exc, ctx.settings.elastic_timeout)
        elif now - self._storage_down_since > ctx.settings.elastic_timeout:
            raise StorageError(f"{exc}; storage did not answer for "
                               f"{now - self._storage_down_since:.0f} s (elastic_timeout)")
        return True

    def _form(self, staying: dict, kept: int) -> bool:
        """Forms and publishes the round of `staying`; returns whether another is needed
        (newcomers it left out, members kept on a draining node, storage to wait for)."""
        ctx = self.ctx
        holders = self.members.holders()  # None: the job never committed, there is no state
        if self._storage_down_since is not None and ctx.clock() < self._storage_next_ask:
            return True  # storage is asked again every STORAGE_POLL_S
        try:
            checkpoint = self._restores(staying, holders)
        except StorageError as exc:
            return self._wait_for_storage(exc)
        if self._storage_down_since is not None:
            progress.info("raytrain-x elastic: storage answers again after %.0f s",
                          ctx.clock() - self._storage_down_since)
            self._storage_down_since = None
        newcomers = sum(m.rank < 0 for m in staying.values())
        if newcomers:
            ctx.log.note("scale_up" if ctx.rounds else "start", joined=newcomers)
        restore = checkpoint is not None
        if restore:
            ctx.log.restoring(checkpoint)
            holders = None  # the round's workers load it from storage
        self.members.failures.count_round(ctx.log.is_reset(), ctx.last_failure)
        version = ctx.rounds_client.hosts_version()
        ctx.rounds += 1
        assignments = plan_round({m.worker_id: (m.node, m.age) for m in staying.values()},
                                 ctx.rounds, version, holders or (), restore,
                                 checkpoint.get("key") if checkpoint else None)
        ctx.round_newcomers = [w for w, m in staying.items() if m.rank < 0]
        ctx.round_members[ctx.rounds] = set(staying)
        for worker_id, place in assignments.items():
            ctx.members[worker_id].rank = place["rank"]
        ctx.rounds_client.publish(assignments)
        if ctx.rounds > ROUNDS_KEPT:
            # every member of that round has left it: the round after it has formed
            ctx.store.forget(round_prefix(ctx.rounds - ROUNDS_KEPT))
        self.members.heartbeats.assigned(assignments, ctx.clock())
        self.members.stragglers.forget(assignments)
        # newcomers still starting join at a later round, once they wait for one; members
        # kept on a draining node leave at the round after this one's first commit
        left_out = sum(m.rank < 0 for m in ctx.staying())
        needs_round = left_out > 0 or bool(kept)
        if kept:
            log.info("raytrain-x elastic: %d worker(s) on draining nodes stay one more round: "
                     "they hold the job's state and no staying worker does yet", kept)
        self._asked_over = False
        self._newcomers_since = None
        entry = ctx.log.record_round(
            ctx.rounds, len(staying), len({m.node for m in staying.values()}),
            len(ctx.pending) + left_out,
            ctx.cluster.capacity.bundles if ctx.cluster.autoscaled else 0, len(ctx.draining))
        progress.info("raytrain-x elastic: %s", round_line(entry))
        return needs_round


def _leave_reason(ctx: JobContext, worker_id: str) -> str:
    """Why a member is sent away: what the policy that asked it to leave said, or its
    node's drain."""
    member = ctx.members[worker_id]
    if member.asked_to_leave is not None:
        return member.asked_to_leave
    return f"node {short_node(member.node)} " \
           f"{ctx.leave_reasons.get(member.node, 'is draining')}"
