"""The worker side of a simulated elastic job: the protocol every worker follows
(`raytrain_x.ray.worker`, `raytrain_x.elastic.state.run`) and the rounds actor it joins.

A worker joins a round at the rounds actor, meets the round's peers at the store (a round
the driver abandoned answers at once; a peer that never comes is waited for `timeout_s`),
syncs the state from rank 0, trains and commits every `commit_s`, rank 0 asking the rounds
actor for the host-set version at each commit (a new version interrupts every rank,
keeping its state), restores the last commit when a peer fails, and leaves when the
driver sends it away at the rendezvous. `WorkerSide` is the part of `World` that runs it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from raytrain_x.comm.groups import round_prefix
from raytrain_x.testing.simulation.model import (
    RPC_S,
    STORE_CALLS_PER_MEMBER,
    Group,
    SimWorker,
    WorldConfig,
)
from raytrain_x.testing.simulation.reshards import Generation, generation, reshard_round
from raytrain_x.testing.simulation.rounds import SimRounds
from raytrain_x.testing.simulation.storage import DAMAGES


class WorkerSide:
    """The worker protocol's events, run on `World`'s clock (its base class)."""

    # what the protocol reads of the world (set by `World.__init__`)
    rng: random.Random
    config: WorldConfig
    now: float
    workers: list[SimWorker]
    groups: dict[int, Group]
    rounds: SimRounds
    store_abandoned: list[str]
    store_forgotten: list[str]
    store_free_at: float  # when the store actor is next free (`store_served`)
    rounds_free_at: float  # when the rounds actor is next free (`_join_arrives`)
    store_dead: bool
    store_epoch: int
    commits: list[tuple[float, int, int]]
    chunks: Generation | None  # the last commit as an FSDP2 model's chunks (`reshards`)
    chunks_lost: int  # rounds that found a chunk with no copy (the real job: storage)
    reshards: int  # rounds whose re-shard was planned and checked
    durable: list[tuple[float, int]]
    storage_restores: list[tuple[float, int]]
    storage_down_until: float
    storage: Any  # a `SimStorage`
    storage_rng: Any
    rot_rng: Any  # bit rot, ranks lost mid-write
    lease: Any  # this run's `WriterLease`
    driver_up: bool
    orphans: set[str]  # workers a driver kill ended: their writer threads may go on
    next_damage: str | None
    damaged_writes: list[float]  # when a write landed damaged or lost a rank mid-write
    writer_outlives: bool
    writing: bool
    last_write: float
    write_asked: bool
    finish_after: float
    outcome_changes: int  # outcomes made or moved so far (the driver's poll rereads them)
    phase_faults: list[tuple[str, Callable[[list[SimWorker]], None]]]
    driver_members: Callable[[], Any]
    trace: Callable[[str], None]

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        raise NotImplementedError

    def outcome_due(self, w: SimWorker, at: float) -> None:
        """`w`'s outcome is visible to the driver from `at` (every change goes through
        here, so the driver's poll knows when to look again)."""
        w.outcome_at = at
        self.outcome_changes += 1

    def violation(self, text: str) -> None:
        raise NotImplementedError

    def execute(self, w: SimWorker) -> None:
        """The pool called `execute`: the worker's first `rx.init()` joins a round."""
        w.outcome = None
        self.outcome_due(w, math.inf)
        self.after(RPC_S, lambda: self._join(w))

    def _join(self, w: SimWorker) -> None:
        if not w.alive:
            return
        w.phase = "joining"
        w.group = None
        w.joining_since = self.now
        w.join_arrived = False
        w.join_attempt += 1
        if w.node.cut(self.now):
            return  # Ray holds the call until the node is reachable again
        self._join_arrives(w)

    def _held_join_arrives(self, w: SimWorker) -> None:
        if w.alive and w.phase == "joining" and not w.join_arrived \
                and not w.node.cut(self.now):
            self._join_arrives(w)

    def store_served(self, cost_s: float, earliest: float) -> float:
        """When calls that reach the store actor at `earliest` are answered: it serves one
        call at a time, in arrival order, these taking `cost_s`."""
        start = max(earliest, self.store_free_at)
        self.store_free_at = start + cost_s
        return self.store_free_at

    def _join_arrives(self, w: SimWorker) -> None:
        # the call has reached the rounds actor, which lists one join at a time in arrival
        # order: listed once the joins before it are (a dead caller's too, as on Ray)
        w.join_arrived = True
        w.join_arrived_at = self.now
        listed = max(self.now, self.rounds_free_at) + self.config.join_call_s
        self.rounds_free_at = listed
        attempt = w.join_attempt
        self.after(listed - self.now, lambda: self._join_listed(w, attempt))

    def _join_listed(self, w: SimWorker, attempt: int) -> None:
        if w.join_attempt == attempt:  # not since replaced by a join of its own
            self.rounds.join(w)

    def placed(self, w: SimWorker, place: dict[str, Any]) -> None:
        """The rounds actor answered `w`'s join."""
        if not w.alive or w.phase != "joining":
            return
        w.joining_since = None
        if place.get("leave"):
            self._ends(w, "left", place["reason"])
            return
        if "error" in place:
            self._ends(w, "failed", place["error"])
            return
        if w.group is not None and w.group.phase != "broken":
            self.violation(f"{w} placed in round {place['round']} while in round "
                           f"{w.group.round_id}")
        group = self.groups.get(place["round"])
        if group is None:
            self.violation(f"{w} placed in round {place['round']}, which was never published")
            return
        w.group = group
        w.phase = "rendezvous"
        # its calls queue at the store behind those of the members placed before it
        at = self.store_served(STORE_CALLS_PER_MEMBER * self.config.store_call_s,
                               self.now + self.rng.uniform(0.02, 0.3))
        self.after(at - self.now, lambda: self._arrive(w, group))

    def _ends(self, w: SimWorker, kind: str, value: Any) -> None:
        w.phase = "done"
        w.outcome = (kind, value)
        self.outcome_due(w, self.now + RPC_S)
        self.trace(f"{w} {kind}: {value}")
        self.rounds.gone(w)

    def _arrive(self, w: SimWorker, group: Group) -> None:
        if not w.alive or w.group is not group or w.phase != "rendezvous":
            return
        if w.node.cut(self.now):
            return  # arrives when the node heals
        if self._forgotten(group):  # a round the job left behind: its peers' keys never come
            self.after(self.config.timeout_s, lambda: self._rendezvous_timeout(w, group))
            return
        if self._abandoned(group):
            self._internal_error(w, f"round {group.round_id} was abandoned")
            return
        # a worker is placed only in a round whose ranks name it: arrivals are a subset of
        # the ranks, so counting them says whether all came (a set per arrival was O(N))
        if group.phase == "broken" and \
                len(group.arrived | {w.worker_id}) == len(group.ranks):
            # every key is there, but a peer left: its connection is refused at once
            self.after(RPC_S, lambda: self._internal_error(w, "a peer left the round", group))
            return
        group.arrived.add(w.worker_id)
        if len(group.arrived) == len(group.ranks) and group.phase == "rendezvous":
            self._formed(group)
        else:
            self.after(self.config.timeout_s, lambda: self._rendezvous_timeout(w, group))

    def _abandoned(self, group: Group) -> bool:
        return _under(group, self.store_abandoned)

    def _forgotten(self, group: Group) -> bool:
        return _under(group, self.store_forgotten)

    def forget(self, prefix: str) -> None:
        """The driver deleted a round's keys: never the newest round's (its members meet
        or train in it); a straggler of the deleted round waits its timeout out."""
        self.store_forgotten.append(prefix)
        newest = max(self.groups, default=0)
        if newest and round_prefix(newest).startswith(prefix):
            self.violation(f"the driver deleted the keys of round {newest}, the newest")

    def abandon(self, prefix: str) -> None:
        self.store_abandoned.append(prefix)
        for group in list(self.groups.values()):
            if group.phase in ("rendezvous", "broken") and self._abandoned(group):
                for w in self._members(group):
                    if w.worker_id in group.arrived:
                        self.after(RPC_S, lambda w=w, g=group: self._internal_error(
                            w, f"round {g.round_id} was abandoned", g))

    def _rendezvous_timeout(self, w: SimWorker, group: Group) -> None:
        """Each member waits for the others' keys on its own, whatever became of them."""
        if w.group is group and w.phase == "rendezvous":
            self._internal_error(w, "a peer did not reach the rendezvous", group)

    def _members(self, group: Group) -> list[SimWorker]:
        return [w for w in self.workers if w.worker_id in group.ranks and w.group is group]

    def _formed(self, group: Group) -> None:
        """Every member's keys are in the store: they connect to each other. A peer that
        died after publishing its address refuses them: they wait the connect out."""
        if self.store_dead or group.store != self.store_epoch:
            # the keys never meet (the store died, or this round is an earlier job's, whose
            # store went with its control actors): each member's own rendezvous timeout
            # ends it
            return
        group.phase = "connect"
        self._fire_phase_faults("connect", group)
        if group.phase != "connect":
            return
        if any(not w.alive for w in self.workers if w.worker_id in group.ranks
               and w.group is group):
            wait = self.config.connect_wait_s
            self.after(self.config.timeout_s if wait is None else wait,
                       lambda: self._connect_failed(group))
            return
        group.phase = "sync"
        for w in self._members(group):
            w.phase = "sync"
        self._fire_phase_faults("sync", group)
        rank0 = next((w for w in self._members(group) if group.ranks[w.worker_id] == 0), None)
        if rank0 is None:
            return
        if self._restores(group):
            self._restore_from_storage(group)
            return
        last = self.job_step()
        if self.commits and rank0.step != last:
            self.violation(f"round {group.round_id} syncs from {rank0} (rank 0), whose state "
                           f"is at commit {rank0.step}, not the job's latest {last}")
        self.after(self.rng.uniform(0.05, 0.3), lambda: self._synced(group, rank0.step))

    def _restores(self, group: Group) -> bool:
        """Whether the round loads a checkpoint (`checkpoint_to_restore`): only when the
        driver said so, whatever its members hold."""
        return group.restore_from_storage

    def job_step(self) -> int:
        """The job's latest committed step: its last commit, or the durable checkpoint
        restored after it (the steps after that one are done again)."""
        last = self.commits[-1] if self.commits else (0.0, 0, 0)
        restored = self.storage_restores[-1] if self.storage_restores else (-1.0, 0)
        return restored[1] if restored[0] >= last[0] else last[2]

    def _restore_from_storage(self, group: Group) -> None:
        """The driver found no holder: the round loads the newest intact checkpoint, which
        rank 0 reads from the real store (its listing sometimes throttled: retried)."""
        if not self.durable:
            self.violation(f"round {group.round_id} restores from storage, but no durable "
                           "checkpoint is complete")
            return
        if self.storage_rng.random() < 0.3:
            self.storage.flaky_listings(self.storage_rng.randint(1, 3))
        if self.storage_rng.random() < 0.2:  # a read cut off midway (a connection reset)
            self.storage.cut_reads(self.storage_rng.randint(1, 2))
        rot = self.rot_rng
        if rot.random() < 0.05:
            self.storage.every_checkpoint_damaged_stops()
        if rot.random() < 0.15:  # bit rot in some of them, never all: one intact is left
            self.storage.rot(lambda keys: rot.sample(keys, rot.randint(0, len(keys) - 1))
                             if keys else [])
        try:  # what `DurableCheckpoints.named` does with the driver's name
            manifest = self.storage.latest()
        except Exception as exc:  # noqa: BLE001 - a violation, whatever it is
            self.violation(f"round {group.round_id}'s restore failed on storage: {exc}")
            return
        named = group.restore_checkpoint
        if named is None:
            self.violation(f"round {group.round_id} restores from storage, but its driver "
                           "named no checkpoint")
        expected = self.storage.expected_latest()
        if manifest is None or expected is None or \
                (manifest.key, manifest.values["step"]) != expected:
            found = None if manifest is None else (manifest.key, manifest.values["step"])
            self.violation(f"round {group.round_id} restores {found} from storage, not the "
                           f"newest intact checkpoint {expected}")
            return
        step = manifest.values["step"]
        rotten = set(self.storage.rotten.values())
        if step < max((s for _, s in self.durable if s not in rotten), default=0):
            self.violation(f"round {group.round_id} restores checkpoint {step}, not the "
                           "latest complete one")
        self.trace(f"round {group.round_id} restores durable checkpoint {manifest.key}")
        self.after(self.rng.uniform(0.3, 2.0), lambda: self._restored(group, step))

    def _restored(self, group: Group, step: int) -> None:
        if group.phase != "sync" or group.stalled_since is not None:
            return
        self.storage_restores.append((self.now, step))
        self._synced(group, step)

    def _maybe_checkpoint(self, rank0: SimWorker, step: int, asked: bool) -> None:
        """Rank 0 marks the commit for a durable checkpoint when one is due (or the driver
        asked for one) and its last write has ended; the write completes (the manifest)
        later, unless storage is down or rank 0's process ends first."""
        every = self.config.checkpoint_every_s
        if every is None:
            return
        self.write_asked = self.write_asked or asked
        if self.writing or (self.now - self.last_write < every and not self.write_asked):
            return
        self.writing, self.last_write, self.write_asked = True, self.now, False
        down_at_start = self.now < self.storage_down_until
        lease = self.lease
        rng = self.storage_rng
        damage = rng.choice(DAMAGES) if rng.random() < 0.1 else None
        damage, self.next_damage = self.next_damage or damage, None
        outlives = rng.random() < 0.5  # a killed driver's writer may go on (its lease not)

        def done() -> None:
            self.writing = False
            goes_on = outlives or self.writer_outlives
            if not rank0.alive and not (goes_on and rank0.worker_id in self.orphans):
                self.trace(f"checkpoint {step} cut off: its writer is gone")
                return
            down = down_at_start or self.now < self.storage_down_until
            outcome = self.storage.write(lease, step, step, damage, full_disk=down,
                                         rank_lost=self.rot_rng.random() < 0.05)
            if outcome.startswith(("damaged", "lost")):  # the one before is restored
                self.damaged_writes.append(self.now)
            if outcome == "complete":
                if lease is not self.lease:  # the next run holds the lease: too late
                    self.violation(f"checkpoint {step} of a run whose lease was taken over "
                                   "completed")
                self.durable.append((self.now, step))
            self.trace(f"checkpoint {step}: {outcome.splitlines()[0][:120]}")
        self.after(self.rng.uniform(*self.config.storage_write_s), done)

    def _connect_failed(self, group: Group) -> None:
        group.phase = "broken"
        for w in self._members(group):
            self._internal_error(w, "a peer refused the connect", group)

    def _synced(self, group: Group, step: int) -> None:
        if group.phase != "sync" or group.stalled_since is not None:
            return
        self._reshard(group, step)
        for w in self._members(group):
            w.phase = "training"
            w.holds = True
            w.step = w.saved = step
            w.state_round = group.round_id
        group.phase = "training"
        self._schedule_commit(group)

    def _reshard(self, group: Group, step: int) -> None:
        """The round syncing commit `step` from memory re-shards the model's chunks as
        FSDP2's would be: its members placed and its plan checked (`reshards`)."""
        members = [w.worker_id for w in sorted(self._members(group),
                                               key=lambda w: group.ranks[w.worker_id])]
        last = self.chunks
        if last is None or last.step != step or group.restore_from_storage:
            group.order = members  # the first round, or from storage: in rank order
            return
        group.order, problems, lost = reshard_round(last, members)
        self.reshards += 1
        for problem in problems:
            self.violation(f"round {group.round_id}'s re-shard of commit {step} "
                           f"({last.world} -> {len(members)} ranks): {problem}")
        if lost:
            self.chunks_lost += 1
            self.trace(f"round {group.round_id}: every copy of {lost[0]} is lost (of "
                       f"{len(lost)}): an FSDP2 job restores from storage")

    def _schedule_commit(self, group: Group) -> None:
        if not group.commit_due:
            group.commit_due = True
            self.after(self.config.commit_s, lambda: self._commit(group))

    def _commit(self, group: Group) -> None:
        group.commit_due = False
        if group.phase != "training":
            return
        if group.stalled_since is not None:
            return  # resumes when the cut-off member is back
        members = self._members(group)
        rank0 = next((w for w in members if group.ranks[w.worker_id] == 0), None)
        if rank0 is None or len(members) != len(group.ranks):
            return  # a member is gone: the others are failing
        self._fire_phase_faults("commit", group)
        if group.phase != "training":
            return
        step = rank0.step + 1
        last = self.job_step()
        if step != last + 1:
            self.violation(f"round {group.round_id} commits step {step} after the job's "
                           f"step {last}")
        self.commits.append((self.now, group.round_id, step))
        for w in members:
            w.step = w.saved = step
            w.state_round = group.round_id
        by_rank = sorted(members, key=lambda w: group.ranks[w.worker_id])
        self.chunks = generation(step, group.order or [w.worker_id for w in by_rank],
                                 [w.worker_id for w in by_rank], [w.node.node_id for w in by_rank])
        if self.rounds.dead:  # saved; telling the rounds actor fails: the driver ends them
            group.phase = "broken"
            return
        version, asked = self.rounds.commit(group.round_id)
        self._maybe_checkpoint(rank0, step, asked)
        if self.now >= self.finish_after:
            group.phase = "done"
            for w in members:
                self._ends(w, "finished", step)
            return
        if version != group.hosts_version:
            group.phase = "broken"
            for w in members:  # HostsUpdatedInterrupt: keep the state, join again
                self.after(RPC_S, lambda w=w: self._join(w))
            return
        self._schedule_commit(group)

    def _peer_gone(self, group: Group, gone: SimWorker) -> None:
        """A member's process ended: its peers' connections to it close at once."""
        if group.phase in ("broken", "done", "connect"):
            return  # a connect under way is waited out (`_formed`)
        if group.phase == "rendezvous":
            return  # the others wait for its keys until their timeout or an abandon
        group.phase = "broken"
        for w in self._members(group):
            if w is not gone:
                self.after(RPC_S, lambda w=w: self._internal_error(
                    w, f"lost peer {gone}", group))

    def _stall(self, group: Group) -> None:
        if group.phase in ("sync", "training") and group.stalled_since is None:
            group.stalled_since = self.now
            self.after(self.config.timeout_s, lambda: self._stall_timeout(group))

    def _unstall(self, group: Group) -> None:
        if group.stalled_since is None or group.phase not in ("sync", "training"):
            return
        if any(w.node.cut(self.now) for w in self._members(group)):
            return
        group.stalled_since = None
        if group.phase == "training":
            self._schedule_commit(group)
        elif self._restores(group):
            self._restore_from_storage(group)  # the restore starts over
        else:
            self.after(0.05, lambda: self._synced(group, self._rank0_step(group)))

    def _rank0_step(self, group: Group) -> int:
        rank0 = next((w for w in self._members(group) if group.ranks[w.worker_id] == 0), None)
        return rank0.step if rank0 is not None else 0

    def _stall_timeout(self, group: Group) -> None:
        if group.stalled_since is None or group.phase not in ("sync", "training"):
            return
        if self.now - group.stalled_since < self.config.timeout_s - 1e-9:
            return
        group.phase = "broken"
        for w in self._members(group):  # the collective times out on every member
            self._internal_error(w, "collective timed out", group)

    def _internal_error(self, w: SimWorker, why: str, group: Group | None = None) -> None:
        """`InternalError` in `elastic.run`: restore the last commit, join again."""
        if not w.alive or (group is not None and w.group is not group):
            return
        if w.phase in ("done", "joining"):
            return
        group = w.group
        if group is not None and group.phase in ("connect", "sync", "training"):
            # it shuts its engine down: its peers' connections to it close at once
            group.phase = "broken"
            for peer in self._members(group):
                if peer is not w:
                    self.after(RPC_S, lambda p=peer, g=group: self._internal_error(
                        p, f"lost peer {w}", g))
        elif group is not None and group.phase != "done":
            group.phase = "broken"
        w.restores += 1
        w.step = w.saved
        self.trace(f"{w} InternalError ({why}); restores commit {w.saved}")
        self.after(RPC_S, lambda: self._join(w))

    # ------------------------------------------------------------------ phase faults
    def on_phase(self, phase: str, fire: Callable[[list[SimWorker]], None]) -> None:
        """`fire(members)` when a round next reaches `phase`, with that round's members."""
        self.phase_faults.append((phase, fire))

    def _fire_phase_faults(self, phase: str, group: Group) -> None:
        """The first fault waiting for `phase` fires on a member of `group`, given in rank
        order (one fault per phase reached: faults that waited long are not all let loose
        at once)."""
        for i, (p, fire) in enumerate(self.phase_faults):
            if p == phase:
                del self.phase_faults[i]
                members = [w for w in self.workers if w.worker_id in group.ranks]
                fire(sorted(members, key=lambda w: group.ranks[w.worker_id]))
                return

    def sent_away(self, w: SimWorker, leaving: set[str]) -> None:
        """The driver sends `w` away (its node drains) with the others in `leaving`: a
        drain must not take the job's last copy of its committed state with it. A worker
        the driver still counts as a member (it has not seen its failure yet) counts as
        keeping the state: the driver decides on what it can know."""
        w.sent_away = True
        last = self.job_step()
        if not self.commits or not (w.holds and w.saved == last):
            return
        if self.durable and max(s for _, s in self.durable) >= last:
            return  # a complete checkpoint holds it (a new job that committed nothing yet)
        known = self.driver_members()
        others = [o for o in self.workers if o.worker_id and o.worker_id not in leaving
                  and o.holds and o.saved == last
                  and ((o.alive and o.reachable(self.now) and o.outcome is None)
                       or o.worker_id in known)]
        if not others:
            self.violation(f"the driver sent {w} away (its node drains) while no other "
                           f"worker held commit {last}: the drain takes the job's state")

    def rendezvous_published(self, group: Group) -> None:
        self.groups[group.round_id] = group
        self._fire_phase_faults("rendezvous", group)


def _under(group: Group, prefixes: list[str]) -> bool:
    """Whether `group`'s round keys fall under one of `prefixes`."""
    prefix = round_prefix(group.round_id)
    return any(prefix.startswith(p) for p in prefixes)
