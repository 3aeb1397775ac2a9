"""The elastic job: keeps a job running while workers come and go.

Each worker actor runs the user function once; its `rx.init()` (and every reset inside
`elastic.run`) waits in the `ElasticRounds` actor until the job forms a round from all live
workers. Dead workers are dropped and their hosts blacklisted; discovered capacity starts
new workers, and survivors meet them at their next `commit()`. On an autoscaling cluster
the job asks the autoscaler for the workers it lacks, and a node Ray drains has its workers
leave at the next commit: nothing is restored or redone, and the host is not blacklisted.

`ElasticJob.run` is the loop: poll, then let each collaborator act. They carry decisions
out; the policies (`policies/`, pure, unit-tested with a fake clock) decide, the worker
pool (`pool.py`) and the cluster view (`cluster.py`) talk to Ray, and everything that
happens goes to one event log (`events.py`). What they share is a `JobContext`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from raytrain_x.common.errors import ControlActorLost, StorageError
from raytrain_x.common.settings import STORAGE_POLL_S
from raytrain_x.ray.elastic.blacklist import Blacklist
from raytrain_x.ray.elastic.context import JobContext
from raytrain_x.ray.elastic.drain_watch import DrainWatch
from raytrain_x.ray.elastic.events import EventLog
from raytrain_x.ray.elastic.member_watch import MemberWatch
from raytrain_x.ray.elastic.parts import JobParts, ray_parts
from raytrain_x.ray.elastic.policies import (
    Change,
    Event,
    JobEnded,
    Phase,
    RoundFormed,
    WorkerFinished,
    next_phase,
)
from raytrain_x.ray.elastic.policy_watch import PolicyWatch
from raytrain_x.ray.elastic.pool import Member, Pending
from raytrain_x.ray.elastic.round_forming import RoundForming
from raytrain_x.ray.elastic.settings import DRAIN_POLL_S, STRAGGLER_POLL_S, ElasticSettings
from raytrain_x.ray.elastic.worker_starts import WorkerStarts

log = logging.getLogger("raytrain_x.elastic")


class ElasticJob:
    """Runs `fn` elastically and returns the results of the workers that finished it."""

    def __init__(self, settings: ElasticSettings, fn: Callable, args: tuple, kwargs: dict,
                 clock: Callable[[], float] = time.monotonic,
                 parts: JobParts | None = None) -> None:
        """`parts`: what the job acts through (default: Ray's, `ray_parts`)."""
        self.settings = settings
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.clock = clock
        self.ctx = JobContext(settings, clock, parts or ray_parts(settings, clock),
                              EventLog(clock), Blacklist(settings.cooldown_range, clock))
        self.member_watch = MemberWatch(self.ctx)
        self.starts = WorkerStarts(self.ctx)
        self.drains = DrainWatch(self.ctx, self.member_watch, self.starts)
        self.forming = RoundForming(self.ctx, self.member_watch)
        self.policies = PolicyWatch(self.ctx, self.member_watch)
        self.phase = Phase.STARTING
        # (time, phase before, phase after, the event that moved it), every move in order
        self.transitions: list[tuple[float, Phase, Phase, Event]] = []
        self._answers: list[Change] = []  # changes since the last round: the next answers

    # ------------------------------------------------------------------ views
    @property
    def members(self) -> dict[str, Member]:
        return self.ctx.members

    @property
    def pending(self) -> dict[Any, Pending]:
        return self.ctx.pending

    @property
    def events(self) -> list:
        """Every event, in order (each reads as a (time, kind, host) tuple)."""
        return self.ctx.log.events

    @property
    def cooldowns(self) -> list[tuple[str, float, float]]:
        return self.ctx.log.cooldowns

    @property
    def gave_up(self) -> list[tuple[float, str, str]]:
        return self.ctx.log.gave_up

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.ctx.log.history

    @property
    def capacity(self) -> Any:
        return self.ctx.cluster.capacity

    @property
    def resets(self) -> int:
        return self.member_watch.failures.resets

    @property
    def failures(self) -> int:
        """Resets that recovered from failed workers (Ray Train's count of failures)."""
        return self.member_watch.failures.failures

    @property
    def log(self) -> EventLog:
        return self.ctx.log

    @property
    def last_failure(self) -> Any:
        return self.ctx.last_failure

    @property
    def rounds(self) -> int:
        return self.ctx.rounds

    @property
    def draining(self) -> dict[str, float]:
        return self.ctx.draining

    @property
    def blacklist(self) -> Blacklist:
        return self.ctx.blacklist

    def staying(self) -> list[Member]:
        """The members whose node is not draining."""
        return self.ctx.staying()

    # ------------------------------------------------------------------ the phase
    def _moved(self, event: Event) -> None:
        """The job's phase after `event` (`policies.TRANSITIONS`)."""
        before = self.phase
        self.phase = next_phase(before, event)
        self.transitions.append((self.clock(), before, self.phase, event))

    def _take(self, changes: list[Change]) -> None:
        """Changes the next round must answer: each moves the phase and is carried into
        the `RoundFormed` that answers it."""
        for change in changes:
            self._moved(change)
            self._answers.append(change)
        if changes:
            self.ctx.needs_round = True

    def _step_rounds(self) -> None:
        """Forms the next round if one is needed and ready (`RoundForming.step`)."""
        ctx = self.ctx
        before = ctx.rounds
        ctx.needs_round = self.forming.step(ctx.needs_round)
        if ctx.rounds > before:
            answers, self._answers = tuple(self._answers), []
            self._moved(RoundFormed(ctx.rounds, len(ctx.round_members.get(ctx.rounds, ())),
                                    answers))

    # ------------------------------------------------------------------ the loop
    def run(self) -> list[Any]:
        ctx = self.ctx
        try:
            self.starts.check_feasible()
            self._take(self.drains.check())
            self.starts.scale_up()
            self.starts.update_request()
            now = self.clock()
            next_discovery = now + self.settings.discovery_interval_s
            next_drain_check = now + DRAIN_POLL_S
            next_straggler_check = now + STRAGGLER_POLL_S
            while True:
                polled = self.member_watch.poll()
                if polled.finished:
                    self._moved(WorkerFinished(next(iter(polled.finished))))
                    results = self._finish(polled.finished)
                    self._moved(JobEnded())
                    return results
                self._take(polled.changes)
                if polled.changes and ctx.cluster.scripted:
                    # a failure blacklists its host: its other workers leave before the
                    # next round forms, not in a round of their own after it
                    self._take(self.drains.check())
                if not ctx.members and ctx.last_failure is not None:
                    self.member_watch.check_all_failed()
                # newcomers are asked over once they wait to join
                self._take(self.starts.poll_pending(self.fn, self.args, self.kwargs))
                if self.clock() >= next_drain_check:
                    self._take(self.drains.check())
                    next_drain_check = self.clock() + DRAIN_POLL_S
                if self.clock() >= next_discovery:
                    ctx.store.check_alive()
                    self.starts.scale_up()
                    self.starts.check_pending()
                    self.starts.update_request()
                    next_discovery = self.clock() + self.settings.discovery_interval_s
                if self.clock() >= next_straggler_check:
                    self._take(self.member_watch.check_stragglers())
                    self._take(self.policies.check())
                    next_straggler_check = self.clock() + STRAGGLER_POLL_S
                self.starts.check_minimum()
                self._step_rounds()
        except BaseException as exc:
            if self.phase is not Phase.ENDED:
                self._moved(JobEnded(type(exc).__name__))
            # a worker that failed calling a dead control actor: their death is the cause
            lost = ctx.parts.control_lost() if isinstance(exc, Exception) and \
                not isinstance(exc, ControlActorLost) else None
            try:
                ctx.rounds_client.fail(f"the elastic job stopped: {exc}")
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
            if lost is not None:
                raise ControlActorLost(lost) from exc
            raise
        finally:
            ctx.cluster.capacity.clear()
            ctx.pool.kill_all()
            ctx.parts.close()

    def _finish(self, finished: dict[str, Any]) -> list[Any]:
        """A worker finished: the job is done. Others get `timeout_s` to finish too."""
        members = self.ctx.members
        finished = self.ctx.pool.collect(finished, self.settings.timeout_s)
        order = sorted(finished, key=lambda w: members[w].rank if w in members else 1 << 30)
        return [finished[w] for w in order]


# how often one run starts again after its control actors died (they live on the head: a
# head that keeps losing them has a problem no restart fixes)
CONTROL_RESTARTS = 3


def run_job(settings: ElasticSettings, new_job: Callable[[], ElasticJob]) -> list[Any]:
    """Runs the job `new_job()` makes. When its rounds or store actor dies
    (`ControlActorLost`), a job with a `CheckpointConfig` and a complete checkpoint starts
    again with new ones from it (a new `new_job()`), up to `CONTROL_RESTARTS` times;
    without one, the error stops it (a new job would silently start over)."""
    restarts = 0
    while True:
        job = new_job()
        try:
            return job.run()
        except ControlActorLost as exc:
            if settings.checkpoint is None or restarts >= CONTROL_RESTARTS or \
                    _latest_number(job, settings.elastic_timeout) is None:
                raise
            restarts += 1
            log.warning("raytrain-x elastic: %s; starting the job again from its latest "
                        "checkpoint (restart %d of at most %d)", exc, restarts,
                        CONTROL_RESTARTS)


def _latest_number(job: ElasticJob, timeout_s: float) -> int | None:
    """The number of the job's latest complete checkpoint (None: none), storage waited for
    as long as `timeout_s` when it does not answer (a restart must not start over, nor fail,
    because an outage and a lost control actor came together).

    Raises:
        StorageError: storage did not answer for `timeout_s`.
    """
    parts = job.ctx.parts
    waited = 0.0
    while True:
        try:
            return parts.latest_checkpoint().get("number")
        except StorageError as exc:
            if waited >= timeout_s:
                raise
            if not waited:
                log.warning("raytrain-x elastic: %s; waiting for storage (at most %.0f s) to "
                            "start the job again from its latest checkpoint", exc, timeout_s)
            parts.sleep(STORAGE_POLL_S)
            waited += STORAGE_POLL_S

