"""Runs the real elastic controller through one simulated schedule and checks the
invariants as the history unfolds (docs/elastic.md, "Simulation")."""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field
from typing import Any

from raytrain_x.common.checkpoint_config import CheckpointConfig
from raytrain_x.common.errors import (
    ConfigError,
    ControlActorLost,
    ElasticStateLost,
    ElasticTimeout,
)
from raytrain_x.common.settings import SILENT_LOST_S, STUCK_GRACE_S
from raytrain_x.ray.elastic.job import ElasticJob, run_job
from raytrain_x.ray.elastic.policies import Phase, RoundFormed, WorkerFailed
from raytrain_x.ray.elastic.settings import ElasticSettings
from raytrain_x.testing.simulation.model import WorldConfig
from raytrain_x.testing.simulation.parts import sim_parts
from raytrain_x.testing.simulation.schedules import Schedule, apply
from raytrain_x.testing.simulation.world import NODE_DEATH_S, DriverKilled, World


class Hang(BaseException):
    """The liveness watchdog stops a job that stopped progressing (a BaseException: the
    controller's own error handling must not swallow it)."""


def recovery_bound(config: WorldConfig) -> float:
    """How long a job may go without a commit after the last fault while it has the
    workers to train: a peer's collective timeout, the straggler rules (silent, then
    stuck), Ray declaring a killed node dead, a worker's start (up to its start timeout)
    and a node's launch, and a few commits."""
    return (config.timeout_s + (config.timeout_s + STUCK_GRACE_S) + SILENT_LOST_S
            + NODE_DEATH_S + config.start_timeout_s + config.launch_s[1]
            + 3 * config.commit_s + 5.0)


@dataclass
class Outcome:
    schedule: Schedule
    violations: list[str]
    stop: str  # "finished" or the documented stop the driver raised
    virtual_s: float
    faults: int  # the schedule's faults that met the job (those after its stop did not)
    commits: int
    recoveries: dict[str, list[float]] = field(default_factory=dict)  # fault kind -> s
    trace: list[str] = field(default_factory=list)
    reshards: int = 0  # rounds that re-sharded the model's chunks, each plan checked
    chunks_lost: int = 0  # of them, rounds that found a chunk with no copy left

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def first_violation_at(self) -> float:
        """Virtual seconds when the first violation was seen (`World.violation` writes it
        first); checks made after the run see it at the run's end."""
        return float(self.violations[0][2:].split("s:", 1)[0])


def settings_for(config: WorldConfig) -> ElasticSettings:
    return ElasticSettings(
        min_workers=config.min_workers, max_workers=config.max_workers, cpus_per_worker=1,
        gpus_per_worker=0, resources_per_worker={}, reset_limit=None,
        cooldown_range=config.cooldown_range, elastic_timeout=config.elastic_timeout,
        timeout_s=config.timeout_s, discovery_interval_s=1.0,
        start_timeout_s=config.start_timeout_s,
        checkpoint=(CheckpointConfig("simulated", name="job", every_s=config.checkpoint_every_s)
                    if config.checkpoint_every_s is not None else None))


class Watchdog:
    """Liveness, checked every virtual second: with at least `min_workers` usable slots
    (nodes up, reachable, not draining, not blacklisted, starting workers; while a
    discovery script fails, only among the hosts it last reported) since the last fault, a
    commit comes within `recovery_bound`."""

    def __init__(self, world: World, job: ElasticJob, schedule: Schedule) -> None:
        self.world, self.job, self.schedule = world, job, schedule
        self.bound = recovery_bound(schedule.config)
        self.last_fault = 0.0
        self.usable_since: float | None = 0.0
        self.short_at: list[float] = []  # times the usable slots were short
        self.end_by = math.inf

    def usable_slots(self) -> int:
        now = self.world.now
        script = self.job.ctx.cluster.script
        seen = (script.health.last or {}) if script is not None and \
            now < self.world.discovery_down_until else None  # the job sees no other node
        listed = script is None or self.world.listed  # a node the script omits is not used
        return sum(n.slots for n in self.world.nodes.values()
                   if (seen is None or n.node_id in seen) and n.up and not n.known_dead
                   and (listed is True or listed(n.node_id))
                   and not n.cut(now) and not n.raylet_dead and n.drain_deadline is None
                   and not n.stuck_starts
                   and not (n.slow_starts and n.slow_starts[0] > self.world.config.start_timeout_s)
                   and not self.job.blacklist.is_blacklisted(n.node_id))

    def tick(self) -> None:
        world = self.world
        now = world.now
        if self.usable_slots() >= self.schedule.config.min_workers:
            if self.usable_since is None:
                self.usable_since = now
        else:
            self.usable_since = None
            self.short_at.append(now)
        last_commit = world.commits[-1][0] if world.commits else 0.0
        if self.usable_since is not None:
            since = max(self.last_fault, last_commit, self.usable_since)
            if now - since > self.bound:
                world.violation(f"liveness: no commit for {now - since:.1f}s (bound "
                                f"{self.bound:.0f}s) with {self.usable_slots()} usable slots; "
                                f"the driver's members: {self._members()}")
                raise Hang()
        if now > self.end_by and self._owes_its_end(now):
            world.violation(f"liveness: the job did not end {self.bound:.0f}s after it was "
                            "asked to")
            raise Hang()
        world.after(1.0, self.tick)

    def _owes_its_end(self, now: float) -> bool:
        """Past `end_by`: the job should have ended, unless its usable slots fell short of
        `min_workers` within the last bound (it waits for capacity, up to its
        `elastic_timeout`, as at its start: a job restored from storage can be there)."""
        short_recently = self.usable_since is None or now - self.usable_since <= self.bound
        return not short_recently or \
            now > self.end_by + self.schedule.config.elastic_timeout + self.bound

    def _members(self) -> str:
        return ", ".join(f"{w}(rank {m.rank}{', leaving' if m.leaving else ''}"
                         f"{', departed' if m.departed else ''}, {m.actor.phase})"
                         for w, m in self.job.members.items()) or "none"


def run_schedule(schedule: Schedule, keep_trace: bool = False) -> Outcome:
    """One history: the schedule's faults against the real controller."""
    lines: list[str] = []
    world_box: list[World] = []

    def trace(line: str) -> None:
        if keep_trace:
            now = world_box[0].now if world_box else 0.0
            lines.append(f"{now:9.3f} {line}")

    world = World(schedule.seed, schedule.config, trace)
    world_box.append(world)
    settings = settings_for(schedule.config)
    jobs = [_driver(world, settings, schedule.seed)]
    dog = Watchdog(world, jobs[0], schedule)
    recoveries: dict[str, list[float]] = {}
    fired = [0]
    for fault in schedule.faults:
        def fire(f=fault) -> None:
            fired[0] += 1
            dog.last_fault = world.now
            world.fault_times.append(world.now)
            _measure_recovery(world, f.kind, recoveries)  # a driver kill raises out of apply
            apply(world, f)
        world.at(fault.at, fire)
    ask_end = schedule.last_fault + (schedule.tail_s or dog.bound / 2)
    world.finish_after = ask_end
    dog.end_by = ask_end + dog.bound
    world.after(1.0, dog.tick)
    # the driver's log is silenced and its progress lines kept for the trace
    driver_lines: list[str] = []
    logger = logging.getLogger("raytrain_x.elastic")
    progress = logging.getLogger("raytrain_x.elastic.progress")
    saved = logger.level, progress.handlers, progress.propagate
    logger.setLevel(logging.CRITICAL)
    progress.handlers, progress.propagate = [_Lines(driver_lines)], False
    try:
        stop = _run_drivers(world, settings, schedule, jobs, dog)
    finally:
        logger.setLevel(saved[0])  # through setLevel: it clears logging's level cache
        progress.handlers, progress.propagate = saved[1:]
    for job in jobs:
        _check_events(world, job)
        _check_phases(world, job)
    _check_restarts(world, jobs)
    _check_pool_drains(world, stop)
    world.storage.check_kept()
    world.violations += world.storage.violations
    if keep_trace:
        lines += [f"driver: {line}" for line in driver_lines]
    return Outcome(schedule, list(world.violations), stop, world.now, fired[0],
                   len(world.commits), recoveries, lines, world.reshards, world.chunks_lost)


def _driver(world: World, settings: ElasticSettings, seed: int) -> ElasticJob:
    """A driver process's job. A later driver (the same command run again) numbers its
    rounds on from the last one's, so the world's records of both stay apart."""
    job = ElasticJob(settings, _never_called, (), {}, clock=lambda: world.now,
                     parts=sim_parts(settings, world))
    job.blacklist.rng = random.Random(seed)  # the cooldowns' jitter
    job.ctx.rounds = max(world.groups, default=0)
    world.driver_members = lambda: job.members
    return job


def _run_drivers(world: World, settings: ElasticSettings, schedule: Schedule,
                 jobs: list[ElasticJob], dog: Watchdog) -> str:
    """Runs the job to its stop through the driver's own `run_job` (a new job with new
    control actors when they died); a killed driver's command runs again after the
    fault's delay, while the faults go on. Returns how the job stopped."""
    fresh = [True]

    def new_job() -> ElasticJob:
        if fresh[0]:  # the job the watchdog was made with
            fresh[0] = False
            return jobs[-1]
        world.new_control()
        jobs.append(_driver(world, settings, schedule.seed + len(jobs)))
        dog.job = jobs[-1]
        dog.last_fault = world.now  # the new job's start counts from here
        return jobs[-1]

    while True:
        try:
            run_job(settings, new_job)
            return "finished"
        except DriverKilled as killed:
            try:
                world.advance(world.now + killed.restart_s)
            except Hang:
                return "hang"
            world.new_driver()
            fresh[0] = False
        except Hang:
            return "hang"
        except ControlActorLost:
            if settings.checkpoint is not None and world.durable:
                world.violation("ControlActorLost stopped a job with a complete durable "
                                "checkpoint: it should have started again from it")
            return "ControlActorLost"
        except ElasticStateLost as exc:
            _check_state_lost(world, jobs[-1], exc)
            return "ElasticStateLost"
        except ElasticTimeout as exc:
            _check_timeout(world, dog, exc)
            return "ElasticTimeout"
        except ConfigError as exc:
            if len(jobs) > 1 and jobs[-1].ctx.rounds == max(world.groups, default=0) \
                    and world.now < world.discovery_down_until:
                # a new driver whose discovery script fails before its first success:
                # nothing to go on, the documented stop of a script that does not work
                return "ConfigError"
            world.violation(f"the driver raised ConfigError, not a documented stop: {exc}")
            return "ConfigError"
        except Exception as exc:  # noqa: BLE001 - any other stop is a violation
            world.violation(f"the driver raised {type(exc).__name__}, not a documented "
                            f"stop: {str(exc).splitlines()[0] if str(exc) else ''}")
            return type(exc).__name__


def _check_restarts(world: World, jobs: list[ElasticJob]) -> None:
    """The driver restarts a worker whose join reached the rounds actor only when it gave
    its round up (`held_back`, by design); rounds are numbered on across drivers."""
    given_up = {e.detail.get("round") for job in jobs for e in job.log.of("abandoned")}
    for w, round_id, at in world.restarted_joins:
        if round_id is None or round_id not in given_up:
            world.violation(f"at {at:.2f}s the driver restarted {w}, whose join the rounds "
                            "actor had received")


class _Lines(logging.Handler):
    """Keeps each record's message."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _never_called(*_: Any) -> None:
    raise AssertionError("a simulated worker runs the protocol, not a function")


def _measure_recovery(world: World, kind: str, into: dict[str, list[float]]) -> None:
    """Seconds from a fault to the next commit of a round formed after it."""
    start = world.now
    rounds_before = max(world.groups, default=0)

    def check() -> None:
        later = [t for t, r, _ in world.commits if t >= start and r > rounds_before]
        if later:
            into.setdefault(kind, []).append(later[0] - start)
        elif world.now - start < 600:
            world.after(0.5, check)
    world.after(0.5, check)


def _check_state_lost(world: World, job: ElasticJob, exc: Exception) -> None:
    """`ElasticStateLost` only when no worker that holds the latest commit is left: each
    holder is gone or failed (its process ended, or it was cut off and failed as lost).
    A holder sent away because its node drains is checked when it is sent
    (`World.sent_away`)."""
    last = world.job_step()
    if world.durable and world.config.checkpoint_every_s is not None:
        world.violation(f"ElasticStateLost while durable checkpoint {world.durable[-1][1]} "
                        "was complete: the job should have restored it")
    holders = [w for w in world.workers if w.holds and w.saved == last and not w.sent_away]
    alive = [w for w in holders if w.alive and w.reachable(world.now)
             and w.worker_id in job.members]
    restarted = [w for w in holders if w.restarted]
    if alive:
        world.violation(f"ElasticStateLost while {alive} held commit {last}, alive and "
                        "reachable members of the job")
    elif restarted:
        world.violation(f"ElasticStateLost after the driver restarted {restarted}, which "
                        f"held commit {last} and answered it")


def _check_timeout(world: World, dog: Watchdog, exc: Exception) -> None:
    window = world.config.elastic_timeout
    if not any(t >= world.now - window - 2.0 for t in dog.short_at):
        world.violation(f"ElasticTimeout though usable slots never fell below min_workers "
                        f"in the last {window:g}s: {exc}")


# the driver sees a drain within its poll (`DRAIN_POLL_S`) and a loop's work
NOTICE_S = 1.0


def _check_pool_drains(world: World, stop: str) -> None:
    """A whole-pool drain whose deadline leaves time for the next commit and a write (two,
    if one was under way) loses no step from before its notice: the job restores a
    checkpoint at least as new, it does not stop with `ElasticStateLost`. Checked where
    nothing else happened from a while before the notice until the deadline (no other
    fault, storage up, no write landing damaged or losing a rank mid-write (the one before
    is then restored), the drain's checkpoint not rotted since, a commit within the second
    before it: the job was training, not in a rendezvous or a restore, whose step is not
    yet the job's)."""
    config = world.config
    if config.checkpoint_every_s is None:
        return
    for at, step, deadline_s in world.pool_drains:
        ends = at + deadline_s
        if not any(at - NOTICE_S <= t <= at for t, _, _ in world.commits):
            continue
        commit = next((t for t, _, _ in world.commits if t >= at + NOTICE_S), None)
        if commit is None:
            continue
        written_by = commit + config.commit_s + 2 * config.storage_write_s[1]
        quiet_from = at - config.timeout_s - NOTICE_S  # a fault before may still be settling
        if written_by >= ends or any(quiet_from <= t <= ends and t != at
                                     for t in world.fault_times) \
                or any(a < written_by and b > at for a, b in world.outages) \
                or any(at <= t <= ends for t in world.damaged_writes) \
                or any(s >= step for s in world.storage.rotten.values()):
            continue
        restored = [s for t, s in world.storage_restores if t > at]
        if restored and restored[0] < step:
            world.violation(f"the pool drained at {at:.2f}s (step {step}, deadline "
                            f"{deadline_s:.1f}s), yet the job restored checkpoint "
                            f"{restored[0]}")
        elif stop == "ElasticStateLost" and not restored:
            world.violation(f"the pool drained at {at:.2f}s (step {step}, deadline "
                            f"{deadline_s:.1f}s), yet the job stopped with ElasticStateLost")


def _check_events(world: World, job: ElasticJob) -> None:
    """Blacklist, cooldown, drains and give-ups as docs/elastic.md states them, and no
    two rounds in a row formed for nothing the driver noted (a round asked over at every
    commit: the job trains one step per round)."""
    blacklisted: dict[str, tuple[float, float]] = {}  # host -> (since, until)
    drained: dict[str, float] = {}
    for e in job.log.events:  # in the order the driver recorded them
        if e.kind == "failure":
            blacklisted[e.host] = (e.time, e.time + e.detail.get("cooldown_s", 0.0))
        elif e.kind == "drain" and e.host and e.detail.get("why", "draining") == "draining":
            drained.setdefault(e.host, e.time)  # Ray's drains are for good; a host that
            # left discovery or was blacklisted comes back
        elif e.kind == "place":
            since, until = blacklisted.get(e.host, (0.0, -1.0))
            if e.time < until:
                world.violation(f"worker placed on {e.host} at {e.time:.2f}s, blacklisted "
                                f"at {since:.2f}s until {until:.2f}s")
            if e.host in drained:
                world.violation(f"worker placed on {e.host} at {e.time:.2f}s, draining since "
                                f"{drained[e.host]:.2f}s")
            # the script's answer the driver had (while the script fails, the last one
            # stands): a host it left out gets no worker
            answer = [hosts for at, hosts in world.script_answers if at <= e.time]
            if answer and e.host not in answer[-1]:
                world.violation(f"worker placed on {e.host} at {e.time:.2f}s, which the "
                                "discovery script's latest answer left out")
    rounds = job.log.of("round")
    for before, e in zip(rounds[1:], rounds[2:]):
        if not before.detail.get("reason") and not e.detail.get("reason"):
            world.violation(f"rounds {before.detail['round']} and {e.detail['round']} formed "
                            f"at {before.time:.2f}s and {e.time:.2f}s with nothing to answer "
                            "(no failure, join, drain or restore noted): a round per commit?")
            break
    for e in job.log.of("gave_up"):
        why = e.detail.get("why", "")
        node = world.nodes.get(e.host)
        if "did not start within" in why:
            continue  # the policy's own clock check (unit-tested)
        if "left the cluster" in why and node is not None and not node.known_dead:
            world.violation(f"gave up on a worker on {e.host}: {why}, but Ray lists it")
    for w in world.workers:
        drained = w.node.drain_deadline is not None
        if drained and w.outcome and w.outcome[0] == "failed" and w.outcome[1] != "lost" \
                and "stopped" not in str(w.outcome[1]):
            world.violation(f"{w} on a draining node failed ({w.outcome[1]}), not left")


def _check_phases(world: World, job: ElasticJob) -> None:
    """The job ended in `Phase.ENDED` (whatever stopped it), and every failure it found was
    carried, as the same value, into the round that answered it, unless no round formed
    after it (the job ended first)."""
    if job.phase is not Phase.ENDED:
        world.violation(f"the driver's job stopped in phase {job.phase.value}, not ended")
    found: list = []
    for _, _, _, event in job.transitions:
        if isinstance(event, WorkerFailed):
            found.append(event)
        elif isinstance(event, RoundFormed):
            lost = [f for f in found if f not in event.answers]
            if lost:
                world.violation(f"round {event.round} formed without answering the failure "
                                f"of {lost[0].worker_id} (rank {lost[0].rank})")
            found = []
