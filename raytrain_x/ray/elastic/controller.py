"""The elastic controller: keeps a job running while workers come and go.

Each worker actor runs the user function once; its `rx.init()` (and every reset inside
`elastic.run`) waits in the `ElasticRounds` actor until the controller forms a round from
all live workers. Dead workers are dropped and their hosts blacklisted; discovered capacity
starts new workers, and survivors meet them at their next `commit()`. On an autoscaling
cluster the controller asks the autoscaler for the workers it lacks, and a node Ray drains
has its workers leave at the next commit: nothing is restored or redone, and the host is
not blacklisted.

The loop only carries out decisions: the policies (`policies.py`, pure, unit-tested with a
fake clock) decide, the worker pool (`pool.py`) and the cluster view (`cluster.py`) talk to
Ray, and everything that happens goes to one event log (`events.py`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from raytrain_x.comm.groups import round_prefix
from raytrain_x.common.errors import WorkerError
from raytrain_x.common.settings import short_node
from raytrain_x.elastic.blacklist import Blacklist
from raytrain_x.elastic.history import round_line
from raytrain_x.ray.elastic.events import EventLog
from raytrain_x.ray.elastic.parts import JobParts, ray_parts
from raytrain_x.ray.elastic.policies import (
    DrainNotice,
    FailurePolicy,
    Heartbeats,
    MinimumWatch,
    ScalingPolicy,
    StragglerRule,
    abandons_forming_round,
    decide_round,
    drain_line,
    elastic_timeout_error,
    held_back,
    held_joins,
    notice_drains,
    spare_last_holders,
    state_lost,
    state_lost_error,
)
from raytrain_x.ray.elastic.pool import Member, Pending
from raytrain_x.ray.elastic.settings import (
    DRAIN_POLL_S,
    GAVE_UP_WARNING_AT,
    PROGRESS_EVERY_S,
    STRAGGLER_POLL_S,
    ElasticSettings,
)
from raytrain_x.ray.elastic_rounds import plan_round
from raytrain_x.ray.failures import (
    JOIN_HELD_S,
    SILENT_LOST_S,
    STUCK_GRACE_S,
    held_join_error,
    stuck_error,
    unreachable_error,
)

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
        self.log = EventLog(clock)
        self.blacklist = Blacklist(settings.cooldown_range, clock)
        self.scaling = ScalingPolicy(settings)
        self.failures = FailurePolicy(settings, self.blacklist)
        self.minimum = MinimumWatch(settings)
        self.stragglers = StragglerRule(lost_after_s=SILENT_LOST_S,
                                        stuck_after_s=settings.timeout_s + STUCK_GRACE_S)
        self.heartbeats = Heartbeats()
        self.parts = parts or ray_parts(settings, clock)
        self.cluster = self.parts.cluster
        self.pool = self.parts.pool
        self.rounds_client = self.parts.rounds
        self.store = self.parts.store
        self.rounds = 0
        self.draining: dict[str, float] = {}  # node -> drain deadline (time.time())
        self.last_failure: WorkerError | None = None
        self._needs_round = True
        self._asked_over = False  # the round's members were asked to a round for newcomers
        self._round_newcomers: list[str] = []  # members whose first round is the latest
        # each round's members, from the last that committed on
        self._round_members: dict[int, set[str]] = {}
        self._progress_at = 0.0
        self._gave_up_warned = False

    # ------------------------------------------------------------------ views
    @property
    def members(self) -> dict[str, Member]:
        return self.pool.members

    @property
    def pending(self) -> dict[Any, Pending]:
        return self.pool.pending

    @property
    def events(self) -> list:
        """Every event, in order (each reads as a (time, kind, host) tuple)."""
        return self.log.events

    @property
    def cooldowns(self) -> list[tuple[str, float, float]]:
        return self.log.cooldowns

    @property
    def gave_up(self) -> list[tuple[float, str, str]]:
        return self.log.gave_up

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.log.history

    @property
    def capacity(self) -> Any:
        return self.cluster.capacity

    @property
    def resets(self) -> int:
        return self.failures.resets

    # ------------------------------------------------------------------ main loop
    def run(self) -> list[Any]:
        try:
            if not self.cluster.scripted:
                self.scaling.check_feasible(self.cluster.nodes(), self.cluster.node_types())
            self._check_drains()
            self._scale_up()
            self._update_request()
            now = self.clock()
            next_discovery = now + self.settings.discovery_interval_s
            next_drain_check = now + DRAIN_POLL_S
            next_straggler_check = now + STRAGGLER_POLL_S
            while True:
                finished = self._poll_members()
                if finished:
                    return self._finish(finished)
                if not self.members and self.last_failure is not None:
                    self._check_all_failed()
                self._poll_pending()  # newcomers are asked over once they wait to join
                if self.clock() >= next_drain_check:
                    self._check_drains()
                    next_drain_check = self.clock() + DRAIN_POLL_S
                if self.clock() >= next_discovery:
                    self._scale_up()
                    self._check_pending()
                    self._update_request()
                    next_discovery = self.clock() + self.settings.discovery_interval_s
                if self.clock() >= next_straggler_check:
                    self._check_stragglers()
                    next_straggler_check = self.clock() + STRAGGLER_POLL_S
                self._check_minimum()
                self._maybe_form_round()
        except BaseException as exc:
            try:
                self.rounds_client.fail(f"the elastic job stopped: {exc}")
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
            raise
        finally:
            self.cluster.capacity.clear()
            self._kill_all()

    # ------------------------------------------------------------------ members
    def _poll_members(self) -> dict[str, Any]:
        if not any(m.ref is not None for m in self.members.values()):
            self.parts.sleep(0.1)
            return {}
        outcomes = self.pool.poll(timeout_s=0.1)
        for member, error in outcomes.failed:
            self._on_failure(member, error)
        for member, left in outcomes.left:
            self.pool.remove(member)
            self.log.add("left", member.node)
            log.info("raytrain-x elastic: worker %s left the job (%s)", member.worker_id,
                     left.reason)
        return outcomes.finished

    def _on_failure(self, member: Member, error: WorkerError) -> None:
        if member.leaving or member.departed:
            # it had left the job's rounds (its node drains): no round waits for it
            self.pool.remove(member)
            self.log.add("left", member.node, lost=True)
            log.info("raytrain-x elastic: worker %s, which had left the job, was lost with its "
                     "draining node", member.worker_id)
            return
        # peers still forming this round with it would wait for its keys until their
        # timeout: they are answered at once and join the next round
        self.store.abandon(round_prefix(self.rounds))
        self.pool.remove(member)
        self.log.note("failure", failed=1)
        self.last_failure = error
        self._needs_round = True
        verdict = self.failures.on_failure(member.node)
        if verdict.kind == "lost_draining":
            self.log.add("lost_draining", member.node)
            log.warning("raytrain-x elastic: worker %s (rank %d) was lost with its draining "
                        "node %s before its next commit; the others restore the last commit",
                        member.worker_id, member.rank, short_node(member.node))
        else:
            self.log.add("failure", member.node, cooldown_s=verdict.cooldown_s)
            log.warning("raytrain-x elastic: worker %s (rank %d) on node %s failed (%s); "
                        "host blacklisted for %s", member.worker_id, member.rank,
                        short_node(member.node), _last_line(error.detail),
                        "good" if verdict.cooldown_s == float("inf")
                        else f"{verdict.cooldown_s:.1f}s")

    def _check_all_failed(self) -> None:
        """No worker is left, the last one having failed. A function that raised fails the
        job with its error, as does any failure when hosts are blacklisted for good. Lost
        processes (killed, crashed, cut off) with a cooldown are waited out like a start
        (`min_workers`, `elastic_timeout`), unless the job had committed: its state went
        with them."""
        failure = self.last_failure
        if not failure.process_lost or self.settings.cooldown_range is None:
            raise failure
        if self.rounds_client.committed():
            raise state_lost_error(failure, self._lost_workers())

    def _lost_workers(self) -> int:
        return len(self.log.of("failure")) + len(self.log.of("lost_draining"))

    def _check_stragglers(self) -> None:
        beats, now = self.heartbeats, self.clock()
        beats.record(*self.pool.beat(), now)
        beats.keep(self.members)
        waiting = self.rounds_client.waiting()
        present = self._present()
        verdict = self.stragglers.observe(
            waiting, present, now, [w for w in present if self.members[w].rank >= 0],
            silent={w: beats.silent_for(w, now) for w in present}, failed=beats.failed)
        if verdict.needs_round:
            self._needs_round = True
        if verdict.lost:
            addresses = self.cluster.addresses()
            self._fail_all(verdict.lost, lambda ranks, nodes: unreachable_error(
                ranks, nodes, "while their peers waited for them at the rendezvous",
                addresses))
        # absent ones that answer: in a join the rounds actor never received? (asked
        # again: one may have arrived since the first look)
        answering = {w: beats.joining[w] for w in verdict.absent
                     if w in beats.joining and w not in verdict.lost}
        if answering:
            held = held_joins(answering, self.rounds_client.waiting(), JOIN_HELD_S)
            held = self._spare_last_holders(held)
            if held:
                self._fail_all(held, held_join_error)
        stuck = self._spare_last_holders(verdict.stuck)
        if stuck:
            where = self.pool.ask(stuck, "where")
            self._fail_all(stuck, lambda ranks, nodes: stuck_error(
                ranks, nodes, self.stragglers.stuck_after_s,
                {self.members[w].rank: at for w, at in where.items()}))

    def _spare_last_holders(self, candidates: list[str]) -> list[str]:
        """`spare_last_holders` of the members about to be restarted, the other holders
        of the state asked first (a ping): one whose node went since the last heartbeat
        answered does not count, and the candidates are then the last holders."""
        if not candidates:
            return candidates
        holders = self._holders()
        if holders is None:
            return candidates
        others = set(holders) & set(self._responsive()) - set(candidates)
        there = self.pool.ask(others, "ping") if others else {}
        return spare_last_holders(candidates, there, holders)

    def _responsive(self) -> list[str]:
        """The members known to be there: they answered the heartbeat's last call (one
        goes out each poll; one whose process or node is gone unseen answers nothing)."""
        beats, now = self.heartbeats, self.clock()
        return [w for w in self.members if w not in beats.failed
                and beats.silent_for(w, now) < 2 * STRAGGLER_POLL_S]

    def _holders(self, committed_round: int | None = None) -> list[str] | None:
        """The workers that hold the job's latest committed state (None: it never
        committed): those that said so when they last joined a round, and the members of
        the round that committed last (they report it only at their next join)."""
        if committed_round is None:
            committed_round = self.rounds_client.committed_round()
        if not committed_round:
            return None
        for old in [r for r in self._round_members if r < committed_round]:
            del self._round_members[old]  # a later round committed: they are not needed
        holders = set(self.rounds_client.holders())
        holders |= self._round_members.get(committed_round, set()) & set(self.members)
        return sorted(holders)

    def _present(self) -> list[str]:
        """The members whose peers may wait for them at the rendezvous. A drained member
        that a round formed without is not one: it is sent away when it arrives, and its
        wait is not a peer waiting for the others (counted as one, it made the members
        training in that round look stuck)."""
        return [w for w, m in self.members.items() if not m.leaving and not m.departed]

    def _fail_all(self, worker_ids: Iterable[str], errors_of: Callable) -> None:
        """Fails these members with one error naming them all: `errors_of(ranks, nodes)`."""
        members = [self.members[w] for w in worker_ids if w in self.members]
        if not members:
            return
        errors = errors_of(sorted(m.rank for m in members), [m.node for m in members])
        for member in members:
            self._on_failure(member, errors[member.rank])

    def _finish(self, finished: dict[str, Any]) -> list[Any]:
        """A worker finished: the job is done. Others get `timeout_s` to finish too."""
        finished = self.pool.collect(finished, self.settings.timeout_s)
        order = sorted(finished, key=lambda w: self.members[w].rank
                       if w in self.members else 1 << 30)
        return [finished[w] for w in order]

    # ------------------------------------------------------------------ capacity
    def _staying(self) -> list[Member]:
        return self.pool.staying(set(self.draining))

    def _used_slots(self) -> dict[str, int]:
        used: dict[str, int] = {}
        for m in self.members.values():
            used[m.node] = used.get(m.node, 0) + 1
        return used

    def _scale_up(self) -> None:
        """Asks for workers on free slots up to max_workers. They join when they answer
        (`_poll_pending`), however long their start takes."""
        usable = self.scaling.usable_slots(self.cluster.free_slots(self._used_slots()),
                                           self.draining, self.blacklist)
        recent = self.clock() - self.settings.start_timeout_s
        slow = {host for at, host, why in self.log.gave_up if at >= recent and "start" in why}
        for node in self.scaling.starts(usable, len(self.members), len(self.pending), slow):
            self.log.add("place", node)
            self.pool.start(node)

    def _update_request(self) -> None:
        """The standing autoscaler request (none with a discovery script: it decides)."""
        if self.cluster.scripted:
            return
        staying, starting = len(self._staying()), len(self.pending)
        unusable = 0
        if self.settings.max_workers - staying - starting > 0:
            unusable = self.cluster.unusable_slots(
                set(self.draining) | set(self.blacklist.blacklisted()))
        self.cluster.capacity.ask(self.scaling.bundles(staying, starting, unusable))

    def _poll_pending(self) -> None:
        """Turns workers that answered into members."""
        settings = self.settings

        def setup(actor: Any, worker_id: str) -> Any:
            return actor.setup_elastic.remote(worker_id, self.rounds_client.actor,
                                              self.store.actor,
                                              settings.timeout_s, settings.env or {},
                                              settings.autotune_actor)

        joined, died = self.pool.poll_pending(setup, self.fn, self.args, self.kwargs)
        for pending, exc in died:
            gone = pending.node not in self.cluster.nodes()
            self._give_up(pending.ref, "its node left the cluster" if gone
                          else f"its actor died while starting: {_first_line(exc)}")
        for member in joined:
            self._needs_round = True
            self.log.add("start", member.node)

    def _check_pending(self) -> None:
        """Gives up on starting workers that cannot start (`ScalingPolicy.give_ups`) and
        prints progress on the others every few seconds."""
        if not self.pending:
            return
        now = self.clock()
        verdicts = self.scaling.give_ups([p.view() for p in self.pending.values()],
                                         self.cluster.nodes(), now)
        for key, why in verdicts:
            self._give_up(key, why)
        if self.pending and now - self._progress_at >= PROGRESS_EVERY_S:
            self._progress_at = now
            oldest = max(now - p.asked_at for p in self.pending.values())
            line = (f"raytrain-x elastic: waiting for {len(self.pending)} workers to start "
                    f"({oldest:.0f} s)")
            log.info(line)
            print(line, flush=True)

    def _give_up(self, key: Any, why: str) -> None:
        pending = self.pool.give_up(key)
        if pending is None:
            return
        self.log.add("gave_up", pending.node, why=why)
        log.warning("raytrain-x elastic: gave up on a worker for %s after %.0f s: %s",
                    short_node(pending.node), self.clock() - pending.asked_at, why)
        gave_up = self.log.gave_up
        if len(gave_up) >= GAVE_UP_WARNING_AT and not self._gave_up_warned:
            self._gave_up_warned = True
            causes = sorted({w for _, _, w in gave_up})
            log.warning("raytrain-x elastic: this job keeps giving up on starting workers "
                        "(%d so far): %s", len(gave_up), "; ".join(causes))

    def _check_drains(self) -> None:
        """Nodes Ray started draining: their starting workers are given up, their members
        leave at the next commit, their capacity is no longer used."""
        draining = self.cluster.draining()
        notice = notice_drains(draining, self.draining,
                               [p.view() for p in self.pending.values()],
                               [m.node for m in self.members.values()])
        self.draining = draining
        for node in notice.new:
            self.failures.drained_nodes.add(node)
            self.log.add("drain", node)
        for key in notice.give_up:
            self._give_up(key, "its node is draining")
        for node, workers in notice.leaving.items():
            _progress(drain_line(node, notice.new[node], self.parts.wall_clock(), workers))
        if notice.interrupt:
            self.log.note("drain")
            self._needs_round = True
            self.rounds_client.bump_hosts()
            self._abandon_forming_round(notice)

    def _abandon_forming_round(self, notice: DrainNotice) -> None:
        """A member of the round still forming is on a draining node: the round is given
        up (its peers' rendezvous waits are answered at once) and the next one forms
        without it. That round's newcomers are restarted when the others can recover
        without them (`held_back`): one slow to arrive would hold up the recovery, and a
        peer already in a gloo wait with it (its group connections, the state sync) would
        wait until it reached its next store call; its process gone, the wait fails at
        once, and a fresh worker takes its slot. Otherwise the next round waits for them."""
        if not self.rounds:
            return
        in_round = [m.node for m in self.members.values() if m.rank >= 0]
        committed_round = self.rounds_client.committed_round()
        if not abandons_forming_round(notice, in_round, self.rounds, committed_round):
            return
        self.store.abandon(round_prefix(self.rounds))
        # Those not restarted keep their place: the next round waits for them. A round
        # past its store waits (its groups made, its state synced) is not stopped by the
        # give-up: it trains on to its first commit, whose host check sends it back; a
        # round formed without them meanwhile would train beside it from another state.
        restarted = held_back(self._round_newcomers, [m.view() for m in self.members.values()],
                              self.draining, self.settings.min_workers, self._responsive(),
                              self._holders())
        for worker_id in restarted & set(self.members):
            self.pool.remove(self.members[worker_id])
        self.log.add("abandoned", "", round=self.rounds, reason="drain",
                     restarted=len(restarted))
        log.info("raytrain-x elastic: round %d was still forming with a worker on a draining "
                 "node; it is given up and the next forms without it (%d newcomer(s) "
                 "restarted)", self.rounds, len(restarted))

    def _note_left(self, members: list[Member]) -> None:
        """Drained members the next round entry counts as left, each once: when a round
        forms without them (`departed`) or when they are sent away at the rendezvous
        (`leaving`), whichever comes first. Called before either flag is set."""
        new = [m for m in members if not (m.leaving or m.departed)]
        if new:
            self.log.note("drain", left=len(new))

    def _check_minimum(self) -> None:
        staying = len(self._staying())
        verdict = self.minimum.observe(staying, self.clock())
        if verdict == "below":
            log.warning("raytrain-x elastic: %d workers, fewer than min_workers=%d; waiting up "
                        "to %.0fs for capacity", staying, self.settings.min_workers,
                        self.settings.elastic_timeout)
        elif verdict == "timeout":
            raise elastic_timeout_error(self.settings, staying, len(self.pending),
                                        self.cluster.capacity.bundles,
                                        self.blacklist.blacklisted())

    # ------------------------------------------------------------------ rounds
    def _maybe_form_round(self) -> None:
        # a drained member the last round formed without is sent away when it arrives
        departing = any(m.departed and not m.leaving for m in self.members.values())
        if not self._needs_round and not departing:
            return
        waiting = self.rounds_client.waiting()
        committed_round = self.rounds_client.committed_round()
        holders = self._holders(committed_round)
        decision = decide_round(waiting, [m.view() for m in self.members.values()],
                                self.draining, self.settings.min_workers,
                                committed_round >= self.rounds, holders)
        if decision.leave:  # they return from `execute` with `Left`; the poll drops them
            self.rounds_client.publish(
                {w: {"leave": True,
                     "reason": f"node {short_node(self.members[w].node)} is draining"}
                 for w in decision.leave})
            leaving = [self.members[w] for w in decision.leave]
            self._note_left(leaving)
            for member in leaving:
                member.leaving = True
        if not self._needs_round:
            return
        if (decision.interrupt or decision.release) and not self._asked_over:
            self._asked_over = True
            self.rounds_client.bump_hosts()
            if decision.interrupt:
                self.log.add("scale_up")
        if not decision.form:
            return  # survivors are still on their way to the rendezvous
        departed = [self.members[w] for w in decision.departed]
        self._note_left(departed)  # the round forms without them: they left with it
        for member in departed:
            member.departed = True
        staying = {w: self.members[w] for w in decision.ranks}
        newcomers = sum(m.rank < 0 for m in staying.values())
        if newcomers:
            self.log.note("scale_up" if self.rounds else "start", joined=newcomers)
        holders = self._holders()  # None: the job never committed, there is no state
        if holders is not None and state_lost(staying, holders, committed=True):
            raise state_lost_error(self.last_failure, self._lost_workers())
        self.failures.count_round(self.log.is_reset(), self.last_failure)
        version = self.rounds_client.hosts_version()
        self.rounds += 1
        assignments = plan_round({m.worker_id: (m.node, m.age) for m in staying.values()},
                                 self.rounds, version, holders or ())
        self._round_newcomers = [w for w, m in staying.items() if m.rank < 0]
        self._round_members[self.rounds] = set(staying)
        for worker_id, place in assignments.items():
            self.members[worker_id].rank = place["rank"]
        self.rounds_client.publish(assignments)
        # newcomers still starting join at a later round, once they wait for one; members
        # kept on a draining node leave at the round after this one's first commit
        left_out = sum(m.rank < 0 for m in self._staying())
        self._needs_round = left_out > 0 or bool(decision.kept)
        if decision.kept:
            log.info("raytrain-x elastic: %d worker(s) on draining nodes stay one more round: "
                     "they hold the job's state and no staying worker does yet",
                     len(decision.kept))
        self._asked_over = False
        entry = self.log.record_round(
            self.rounds, len(staying), len({m.node for m in staying.values()}),
            len(self.pending) + left_out, self.cluster.capacity.bundles, len(self.draining))
        _progress(round_line(entry))

    def _kill_all(self) -> None:
        self.pool.kill_all()
        self.parts.close()


def _progress(line: str) -> None:
    """A line for the driver's user: logged, and printed (a notebook shows no log)."""
    log.info("raytrain-x elastic: %s", line)
    print(f"raytrain-x elastic: {line}", flush=True)


def _last_line(text: str) -> str:
    """The line of a traceback that names the error."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else "no detail"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

