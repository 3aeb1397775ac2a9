"""Drains: nodes Ray started draining, and, with a discovery script or a host list
(Horovod's hosts), hosts the discovery no longer lists and blacklisted hosts. Their starting
workers are given up, their members leave at the next commit, their capacity is no longer
used, and a round still forming with one of their workers is given up."""

from __future__ import annotations

import logging
import math

from raytrain_x.comm.groups import round_prefix
from raytrain_x.common.logs import progress_logger
from raytrain_x.ray.elastic.context import JobContext
from raytrain_x.ray.elastic.member_watch import MemberWatch
from raytrain_x.ray.elastic.policies import (
    DrainNotice,
    NodesDraining,
    abandons_forming_round,
    asks_checkpoint,
    drain_line,
    held_back,
    notice_drains,
)
from raytrain_x.ray.elastic.pool import Member
from raytrain_x.ray.elastic.worker_starts import WorkerStarts

log = logging.getLogger("raytrain_x.elastic")
progress = progress_logger("raytrain_x.elastic.progress")


class DrainWatch:
    """Carries out what `notice_drains`, `abandons_forming_round` and `held_back` decide."""

    def __init__(self, ctx: JobContext, members: MemberWatch, starts: WorkerStarts) -> None:
        self.ctx = ctx
        self.members = members
        self.starts = starts

    def check(self) -> list[NodesDraining]:
        """Takes in the nodes that started draining since the last look; returns them as
        the change a round must answer (their members leave), or none."""
        ctx = self.ctx
        ray_draining = ctx.cluster.draining()
        draining = {**self._departing(), **ray_draining}
        notice = notice_drains(draining, ctx.draining,
                               [p.view() for p in ctx.pending.values()],
                               [m.node for m in ctx.members.values()])
        ctx.draining = draining
        for node in notice.new:
            if node in ray_draining:
                self.members.failures.note_drained(node)
            ctx.log.add("drain", node, why=ctx.leave_reasons.get(node, "draining"))
        for key in notice.give_up:
            self.starts.give_up(key, "its node is draining")
        for node, workers in notice.leaving.items():
            progress.info("raytrain-x elastic: %s",
                          drain_line(node, notice.new[node], ctx.parts.wall_clock(), workers,
                                     ctx.leave_reasons.get(node, "is draining")))
        self._ask_checkpoint(notice)
        if notice.interrupt:
            ctx.log.note("drain")
            ctx.rounds_client.bump_hosts()
            self._abandon_forming_round(notice)
        return [NodesDraining(tuple(sorted(notice.leaving)))] if notice.interrupt else []

    def _departing(self) -> dict[str, float]:
        """Horovod's hosts that go (no deadline: their members leave at the next commit):
        with a discovery script or a host list, those with members that the discovery no
        longer lists, and blacklisted ones (a worker there failed: Horovod takes the whole
        host out until its cooldown ends). With Ray's nodes as the hosts, a failure only
        keeps new workers off its node."""
        ctx = self.ctx
        ctx.leave_reasons = {}
        if not ctx.cluster.scripted:
            return {}
        nodes = {m.node for m in ctx.members.values()} | {p.node for p in ctx.pending.values()}
        listed = ctx.cluster.discovered()
        for node in sorted(nodes):
            if listed is not None and node not in listed:
                ctx.leave_reasons[node] = "left host discovery"
            elif ctx.blacklist.is_blacklisted(node):
                ctx.leave_reasons[node] = "is blacklisted"
        return dict.fromkeys(ctx.leave_reasons, math.inf)

    def _ask_checkpoint(self, notice: DrainNotice) -> None:
        """Every holder of the state is now draining: rank 0 writes a durable checkpoint at
        its next commit (asked before the hosts change, so that commit writes it)."""
        ctx = self.ctx
        nodes = {w: m.node for w, m in ctx.members.items()}
        if not asks_checkpoint(notice, self.members.holders(), nodes, ctx.draining,
                               ctx.settings.checkpoint is not None):
            return
        ctx.rounds_client.ask_checkpoint()
        ctx.log.add("checkpoint_asked", "", nodes=sorted(notice.new))
        progress.info("raytrain-x elastic: every worker holding the state is on a draining "
                      "node; rank 0 writes a durable checkpoint at its next commit")

    def _abandon_forming_round(self, notice: DrainNotice) -> None:
        """A member of the round still forming is on a draining node: the round is given
        up (its peers' rendezvous waits are answered at once) and the next one forms
        without it. That round's newcomers are restarted when the others can recover
        without them (`held_back`): one slow to arrive would hold up the recovery, and a
        peer already in a gloo wait with it (its group connections, the state sync) would
        wait until it reached its next store call; its process gone, the wait fails at
        once, and a fresh worker takes its slot. Otherwise the next round waits for them."""
        ctx = self.ctx
        if not ctx.rounds:
            return
        in_round = [m.node for m in ctx.members.values() if m.rank >= 0]
        committed_round = ctx.rounds_client.committed_round()
        # every member of the round answers and said, at its last heartbeat, that it synced
        # in it (one gone unseen may not have: the round is then taken as still forming)
        synced_in, answering = self.members.heartbeats.state_rounds, \
            set(self.members.responsive())
        synced = bool(in_round) and all(synced_in.get(w, 0) >= ctx.rounds and w in answering
                                        for w, m in ctx.members.items() if m.rank >= 0)
        if not abandons_forming_round(notice, in_round, ctx.rounds, committed_round, synced):
            return
        ctx.store.abandon(round_prefix(ctx.rounds))
        # Those not restarted keep their place: the next round waits for them. A round
        # past its store waits (its groups made, its state synced) is not stopped by the
        # give-up: it trains on to its first commit, whose host check sends it back; a
        # round formed without them meanwhile would train beside it from another state.
        restarted = held_back(ctx.round_newcomers, [m.view() for m in ctx.members.values()],
                              ctx.draining, ctx.settings.min_workers,
                              self.members.responsive(), self.members.holders())
        for worker_id in restarted & set(ctx.members):
            ctx.pool.remove(ctx.members[worker_id])
        ctx.log.add("abandoned", "", round=ctx.rounds, reason="drain",
                    restarted=len(restarted))
        log.info("raytrain-x elastic: round %d was still forming with a worker on a draining "
                 "node; it is given up and the next forms without it (%d newcomer(s) "
                 "restarted)", ctx.rounds, len(restarted))


def note_left(ctx: JobContext, members: list[Member]) -> None:
    """Drained members the next round entry counts as left, each once: when a round
    forms without them (`departed`) or when they are sent away at the rendezvous
    (`leaving`), whichever comes first. Called before either flag is set."""
    new = [m for m in members if not (m.leaving or m.departed)]
    asked = sum(m.asked_to_leave is not None for m in new)
    if asked:
        ctx.log.note("policy", left=asked)
    if len(new) > asked:
        ctx.log.note("drain", left=len(new) - asked)
