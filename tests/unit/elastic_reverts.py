"""The elastic driver as it was before each fix the simulator found: each function puts one
old behaviour back (through pytest's monkeypatch), so a test can show that the fix's named
scenario fails without it."""

from __future__ import annotations

from dataclasses import replace

from raytrain_x.ray.elastic import (
    discovery,
    drain_watch,
    member_watch,
    policies,
    round_forming,
    worker_starts,
)
from raytrain_x.ray.elastic import job as job_module
from raytrain_x.ray.elastic.policies import rounds as round_policy
from raytrain_x.testing.simulation import runner


def rank0_by_age_only(mp) -> None:
    """Rank 0 was the oldest member, whether or not it held the state."""
    plan = round_forming.plan_round
    mp.setattr(round_forming, "plan_round",
               lambda members, r, v, holders=(), *rest: plan(members, r, v, (), *rest))


def drained_holders_leave(mp) -> None:
    """A member on a draining node left at the rendezvous even when it was the job's only
    holder of the state."""
    keep = round_policy.kept_on_drain
    mp.setattr(round_policy, "kept_on_drain",
               lambda members, draining, holders, waiting: keep(members, draining, None, waiting))


def drained_last_round_not_waited(mp) -> None:
    """A last round all on draining nodes was formed without (its members departed)."""
    keep = round_policy.kept_on_drain

    def kept(members, draining, holders, waiting):
        members = list(members)
        staying = [m for m in members if not m.leaving and m.node not in draining]
        if not any(m.in_round for m in staying):
            holders = set(holders or ())
            if any(m.worker_id in holders and m.worker_id in waiting for m in staying):
                return set()
            return {m.worker_id for m in members if not m.leaving and not m.departed
                    and m.node in draining and m.worker_id in holders}
        return keep(members, draining, holders, waiting)
    mp.setattr(round_policy, "kept_on_drain", kept)


def departed_counts_as_present(mp) -> None:
    """A departed member's wait at the rendezvous made the training members stragglers."""
    mp.setattr(member_watch.MemberWatch, "present",
               lambda self: [w for w, m in self.ctx.members.items() if not m.leaving])


def slow_nodes_first(mp) -> None:
    """Workers were placed in node id order, a node where starts failed included."""
    starts = policies.ScalingPolicy.starts
    mp.setattr(policies.ScalingPolicy, "starts",
               lambda self, usable, members, pending, last_resort=(), **rest:
               starts(self, usable, members, pending, **rest))


REVERTS = {
    "rank0-holds-state": rank0_by_age_only,
    "drained-holder-kept": drained_holders_leave,
    "drained-last-round-waited": drained_last_round_not_waited,
    "departed-not-a-straggler": departed_counts_as_present,
    "slow-node-last-resort": slow_nodes_first,
}


def last_holders_restarted(mp) -> None:
    """Members that answered but stayed away (held joins, stuck) were restarted even when
    they alone held the state."""
    mp.setattr(member_watch, "spare_last_holders", lambda candidates, members, holders:
               list(candidates))


REVERTS["last-holder-spared"] = last_holders_restarted


def synced_newcomers_restarted(mp) -> None:
    """A drain that gave up a forming round restarted its newcomers whenever the round's
    other members were enough, counted whether or not they still answered, and whether
    or not the newcomers had synced the state by then."""
    held = policies.held_back
    mp.setattr(drain_watch, "held_back",
               lambda newcomers, members, draining, min_workers, responsive, holders:
               held(newcomers, list(members), draining, min_workers,
                    [m.worker_id for m in members], None))


def other_holders_not_asked(mp) -> None:
    """Held or stuck members were restarted when another holder had answered the last
    heartbeat, though its node may have gone since."""
    def spare(self, candidates):
        holders = self.holders()
        return candidates if holders is None else \
            member_watch.spare_last_holders(candidates, self.responsive(), holders)
    mp.setattr(member_watch.MemberWatch, "spare_last_holders", spare)


REVERTS["synced-newcomer-kept"] = synced_newcomers_restarted
REVERTS["other-holder-asked"] = other_holders_not_asked


def stale_joins_held(mp) -> None:
    """A member's last answer that it was in its call to join counted as a held join,
    though that join had begun before the member was given its rank (the rounds actor's
    answer had not reached it yet)."""
    mp.setattr(policies.Heartbeats, "joins",
               lambda self: {w: s for w, s in self.joining.items() if s > 0})


REVERTS["late-placed-answer"] = stale_joins_held


def absence_outlives_placement(mp) -> None:
    """A member's absence from the rendezvous counted from before a round placed it."""
    mp.setattr(policies.StragglerRule, "forget", lambda self, worker_ids: None)


REVERTS["placed-member-not-stuck"] = absence_outlives_placement


def holders_only_from_joins(mp) -> None:
    """The driver knew a worker held the state only from its joins (and the round that
    committed last), not from its heartbeat."""
    mp.setattr(member_watch, "current_holders", lambda state_rounds, committed_round: [])


REVERTS["synced-holder-heard-by-heartbeat"] = holders_only_from_joins


def slow_nodes_forgotten(mp) -> None:
    """A node where a worker did not start was placed last only for `start_timeout_s`."""
    recent = [0.0]  # give-ups since then count, as of the scale-up under way
    scale_up = worker_starts.WorkerStarts.scale_up

    def forgetting(self) -> None:
        recent[0] = self.ctx.clock() - self.ctx.settings.start_timeout_s
        scale_up(self)
    mp.setattr(worker_starts.WorkerStarts, "scale_up", forgetting)
    mp.setattr(worker_starts, "last_resort_nodes", lambda gave_up, started: {
        h for at, h, why in gave_up if at >= recent[0] and "start" in why})
    unproven_nodes_filled(mp)  # the later rule alone spreads these starts too


def draining_members_fill_max_workers(mp) -> None:
    """Members on draining nodes counted as staying: with max_workers all on draining
    nodes, no replacement started until they left."""
    starts = policies.ScalingPolicy.starts
    mp.setattr(policies.ScalingPolicy, "starts",
               lambda self, usable, members, pending, last_resort=(), staying=None, **rest:
               starts(self, usable, members, pending, last_resort, **rest))


def starting_nodes_filled_first(mp) -> None:
    """Replacements filled the nodes in id order, one where a worker was still starting
    (and might never) included."""
    starts = policies.ScalingPolicy.starts
    mp.setattr(policies.ScalingPolicy, "starts",
               lambda self, usable, members, pending, last_resort=(), staying=None,
               starting=None: starts(self, usable, members, pending, last_resort, staying))


REVERTS["slow-node-not-forgotten"] = slow_nodes_forgotten
REVERTS["draining-members-replaced"] = draining_members_fill_max_workers
REVERTS["starts-spread-off-unproven-node"] = starting_nodes_filled_first


def durable_floor_ignored(mp) -> None:
    """Before durable checkpoints: losing every holder stopped the job with
    `ElasticStateLost`, though a complete checkpoint was there to restore."""
    mp.setattr(member_watch.MemberWatch, "durable_floor", lambda self: None)


def restore_not_told(mp) -> None:
    """The round restoring from storage did not say so: its workers synced from rank 0,
    which held no state (or an older one). (The workers once also restored on their own
    when no member held any state; only the driver decides now.)"""
    plan = round_forming.plan_round
    mp.setattr(round_forming, "plan_round",
               lambda members, r, v, holders=(), restore=False, named=None:
               plan(members, r, v, holders))


REVERTS["durable-whole-job-lost"] = durable_floor_ignored
REVERTS["durable-lost-twice"] = restore_not_told


def unproven_nodes_filled(mp) -> None:
    """Starts filled each node in turn, nodes no worker had started on too."""
    starts = policies.ScalingPolicy.starts
    mp.setattr(policies.ScalingPolicy, "starts",
               lambda self, *args, proven=(), **rest: starts(self, *args, **rest))


REVERTS["starts-one-per-unproven-node"] = unproven_nodes_filled


def last_resorts_by_id(mp) -> None:
    """Last-resort nodes were taken in node id order: two that kept failing starved one
    whose only failure was long ago."""
    last = worker_starts.last_resort_nodes
    mp.setattr(worker_starts, "last_resort_nodes",
               lambda gave_up, started: set(last(gave_up, started)))


REVERTS["last-resorts-take-turns"] = last_resorts_by_id


def starts_never_hedged(mp) -> None:
    """Below min_workers, starts that hung or were slow held the job's whole room until
    start_timeout_s."""
    mp.setattr(policies.ScalingPolicy, "stale", lambda self, pending, now: [])


REVERTS["hedged-start-below-minimum"] = starts_never_hedged


def hedges_replace_slow_starts(mp) -> None:
    """A hedge gave up the stale start it hedged at once, below min_workers too."""
    def surplus(self, pending, staying, now):
        pending = list(pending)
        excess = staying + len(pending) - self.settings.max_workers
        return self.stale(pending, now)[:max(0, excess)]
    mp.setattr(policies.ScalingPolicy, "surplus", surplus)


REVERTS["hedges-keep-slow-starts"] = hedges_replace_slow_starts


def unhedged(revert):
    """`revert`, with no hedged starts either. Where starts go (these fixes) and hedging a
    start that waits too long are two defences against the same loss, a job below
    min_workers whose starts hang: each alone keeps these scenarios' jobs, so each is
    shown on them with the other off."""
    def both(mp) -> None:
        revert(mp)
        starts_never_hedged(mp)
    both.__doc__ = revert.__doc__
    return both


for _name in ("slow-node-last-resort", "slow-node-not-forgotten",
              "starts-one-per-unproven-node", "last-resorts-take-turns"):
    REVERTS[_name] = unhedged(REVERTS[_name])


def pool_drain_not_written(mp) -> None:
    """A drain of every holder asked for no checkpoint: the job restored the last periodic
    one."""
    mp.setattr(drain_watch, "asks_checkpoint", lambda *args: False)


REVERTS["durable-whole-pool-drain"] = pool_drain_not_written


def resume_not_checked(mp) -> None:
    """A new driver's first round (every worker new, none holding any state) synced from
    rank 0 instead of restoring the latest checkpoint: the job started over (neither the
    driver nor the workers looked for one)."""
    restores = round_forming.RoundForming._restores

    def lost_only(self, staying, holders):
        return None if holders is None else restores(self, staying, holders)

    mp.setattr(round_forming.RoundForming, "_restores", lost_only)


REVERTS["durable-driver-killed"] = resume_not_checked


def storage_outage_fatal_to_a_restore(mp) -> None:
    """A round that had to restore while storage did not answer raised the listing's
    `StorageError`: every worker lost during an outage stopped the job, though storage came
    back seconds later with the checkpoint in it."""
    def fatal(self, exc):
        raise exc
    mp.setattr(round_forming.RoundForming, "_wait_for_storage", fatal)


REVERTS["durable-storage-down-then-job-lost"] = storage_outage_fatal_to_a_restore


def discovery_failure_fatal(mp) -> None:
    """One failed run of the discovery script stopped the job."""
    def failed(self, error, now):
        raise error
    mp.setattr(discovery.DiscoveryHealth, "failed", failed)


REVERTS["scripted-discovery-fails-and-recovers"] = discovery_failure_fatal


def control_loss_fatal(mp) -> None:
    """A dead rounds or store actor stopped the job, checkpoint or not."""
    def run_once(settings, new_job):
        return new_job().run()
    mp.setattr(job_module, "run_job", run_once)
    mp.setattr(runner, "run_job", run_once)


REVERTS["durable-control-actors-killed"] = control_loss_fatal


def stale_writers_not_fenced(mp) -> None:
    """A run's writer did not check its lease before a manifest or a prune (no fencing):
    a killed driver's writer completed after the next run took the lease."""
    from raytrain_x.elastic.lease import WriterLease

    mp.setattr(WriterLease, "check", lambda self: None)


def damaged_writes_not_read_back(mp) -> None:
    """A part counted as written once it was uploaded, unread: a checkpoint that landed
    damaged completed and pruned the intact checkpoint before it."""
    from raytrain_x.elastic.checkpoints import CheckpointStore

    mp.setattr(CheckpointStore, "read_back", lambda self, key, part, files: "")


def renewals_overwrite_the_lease(mp) -> None:
    """A renewal rewrote the job's one lease file whole: the killed run's renewal, checked
    before the takeover and landing after it, undid the new run's generation."""
    from raytrain_x.elastic.lease import WriterLease

    def write_renewal(self) -> None:
        top = max(self.generations(), default=self.generation)
        self.store.storage.publish(self._path(top), self._record())

    mp.setattr(WriterLease, "write_renewal", write_renewal)


def reads_unchecked(mp) -> None:
    """A restore's reads were not checked as they were read (rank 0 checked every file
    first, then the ranks read them again): bit rot after that check was restored."""
    from raytrain_x.elastic.checksums import PartFiles

    def unchecked(self, file, offset, length, pieces, hold):
        yield from self.storage.chunks(f"{self.folder}/{file}", offset, length)

    mp.setattr(PartFiles, "_checked", unchecked)


REVERTS["durable-stale-writer-fenced"] = stale_writers_not_fenced
REVERTS["durable-bit-rot-found-as-read"] = reads_unchecked
REVERTS["durable-late-renewal-after-takeover"] = renewals_overwrite_the_lease
REVERTS["durable-damaged-write-skipped"] = damaged_writes_not_read_back


def starts_not_counted(mp) -> None:
    """A discovery script's slots were taken by members only: a start under way did not
    count, so the next look started a second worker on its slot (one that never starts),
    and with max_workers reached by such starts no other host got a worker."""
    def used(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.ctx.members.values():
            out[m.node] = out.get(m.node, 0) + 1
        return out
    mp.setattr(worker_starts.WorkerStarts, "_used_slots", used)


REVERTS["scripted-host-leaves-discovery"] = starts_not_counted


def round_all_draining_released(mp) -> None:
    """A round that kept members on a draining node was asked over at its commit though
    no member of it stayed: with nowhere to go, one round formed per commit."""
    decide = round_policy.decide_round

    def decide_round(waiting, members, draining, min_workers, round_committed=True,
                     holders=None):
        members = list(members)
        decision = decide(waiting, members, draining, min_workers, round_committed, holders)
        draining = set(draining)
        release = (holders is not None and round_committed and not decision.form
                   and any(m.in_round and not m.leaving and m.node in draining
                           and m.worker_id not in set(waiting) for m in members))
        return replace(decision, release=release)
    mp.setattr(round_forming, "decide_round", decide_round)


REVERTS["durable-pool-drains-node-by-node"] = round_all_draining_released
