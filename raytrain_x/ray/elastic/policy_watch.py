"""Carries out what the policies a user injected (`ElasticSettings.policies`) decide: shows
them the current round's members (their work per step, from the heartbeat) and sends away
the workers they say must leave, at their next commit."""

from __future__ import annotations

import logging

from raytrain_x.common.logs import progress_logger
from raytrain_x.common.settings import short_node
from raytrain_x.ray.elastic.context import JobContext
from raytrain_x.ray.elastic.member_watch import MemberWatch
from raytrain_x.ray.elastic.policies import AskedToLeave, JobSnapshot, Leave, WorkerSample
from raytrain_x.ray.elastic.pool import Member

log = logging.getLogger("raytrain_x.elastic")
progress = progress_logger("raytrain_x.elastic.progress")


class PolicyWatch:
    """Asks each injected policy to `decide` on one snapshot of the job per look."""

    def __init__(self, ctx: JobContext, members: MemberWatch) -> None:
        self.ctx = ctx
        self.members = members
        self.policies = list(ctx.settings.policies)

    def _in_round(self) -> list[Member]:
        """The members of the current round that stay (none leaving or asked to)."""
        return [m for m in self.ctx.staying() if m.rank >= 0 and not m.departed]

    def snapshot(self) -> JobSnapshot:
        """The members of the current round that stay, with the work per step each last
        reported in it."""
        ctx = self.ctx
        work = self.members.heartbeats.work
        return JobSnapshot(
            members=tuple(WorkerSample(m.worker_id, m.node, m.rank,
                                       *work.get(m.worker_id, (0.0, 0)))
                          for m in sorted(self._in_round(), key=lambda m: m.rank)),
            min_workers=ctx.settings.min_workers, round=ctx.rounds, now=ctx.clock())

    def check(self) -> list[AskedToLeave]:
        """Returns the members that must leave, as the change the next round answers
        (every rank is asked over at its next commit; the round forms without them)."""
        if not self.policies or not self.ctx.rounds:
            return []
        job = self.snapshot()
        leaving: list[AskedToLeave] = []
        for policy in self.policies:
            for leave in policy.decide(job):
                leaving += self._leave(leave, type(policy).__name__)
        if leaving:
            self.ctx.rounds_client.bump_hosts()
        return leaving

    def _leave(self, leave: Leave, policy: str) -> list[AskedToLeave]:
        ctx = self.ctx
        member = ctx.members.get(leave.worker_id)
        if member is None or member.asked_to_leave is not None or member.leaving:
            return []
        if len(self._in_round()) - 1 < max(1, ctx.settings.min_workers):
            log.info("raytrain-x elastic: %s asked worker %s to leave; it stays (the job "
                     "would fall below min_workers=%d)", policy, leave.worker_id,
                     ctx.settings.min_workers)
            return []
        member.asked_to_leave = f"{policy}: {leave.reason}"
        if leave.cooldown_s > 0:
            ctx.blacklist.rest(member.node, leave.cooldown_s)
        ctx.log.add("asked_to_leave", member.node, worker=leave.worker_id, rank=member.rank,
                    policy=policy, reason=leave.reason, cooldown_s=leave.cooldown_s)
        progress.info("raytrain-x elastic: rank %d (worker %s on node %s) leaves at its next "
                      "commit: %s, %s", member.rank, leave.worker_id, short_node(member.node),
                      policy, leave.reason)
        return [AskedToLeave(leave.worker_id, policy, leave.reason)]
