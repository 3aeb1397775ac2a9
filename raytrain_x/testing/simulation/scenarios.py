"""The named scenarios: the faults real runs and the simulator found, one schedule each
(docs/elastic.md, "Chaos soak" and "Simulation"), and those of durable checkpoints."""

from __future__ import annotations

from dataclasses import replace

from raytrain_x.testing.simulation.model import WorldConfig
from raytrain_x.testing.simulation.schedules import Fault, Schedule


def _named(name: str, config: WorldConfig, faults: list, note: str, seed: int = 0) -> Schedule:
    return Schedule(seed, config, tuple(f if isinstance(f, Fault) else Fault(*f)
                                        for f in faults), name=name, notes=(note,))


THREE = WorldConfig(nodes=3, slots=1, max_nodes=4, min_workers=1, max_workers=3,
                    timeout_s=10.0, commit_s=0.5)
# the real drain-then-kill test: 3 one-slot nodes, no node joins, the example's 30 s timeout
DRAIN_TEST = WorldConfig(nodes=3, slots=1, max_nodes=3, min_workers=1, max_workers=3,
                         timeout_s=30.0, commit_s=0.5, autoscaler=False, respawn=False)
TWO_MIN = WorldConfig(nodes=4, slots=1, max_nodes=5, min_workers=2, max_workers=4,
                      timeout_s=10.0, commit_s=0.5)


def scenarios() -> dict[str, Schedule]:
    """The faults real runs found, one schedule each (docs/elastic.md, "Chaos soak")."""
    s = [
        _named("drain-then-kill", DRAIN_TEST, [
            Fault(6.0, "drain", 0.99, 60.0), Fault(6.0, "node_kill_in_connect", 0.0)],
            "the hang of real runs: one node drained (60 s deadline), then rank 0's node "
            "killed as the drain's round connected (no node may join, as in the real test)"),
        _named("drain-then-kill-apart", THREE, [
            Fault(6.0, "drain_kill", 0.99, 2.0), Fault(8.5, "kill_node", 0.0)],
            "a drain notice, its node killed 2 s later, then another node"),
        _named("1-peer-lost-in-first-round", THREE, [Fault(0.0, "kill_in_rendezvous", 0.5)],
               "a peer lost while the first rx.init() formed the world"),
        _named("2-dead-peer-in-rendezvous", THREE, [Fault(5.0, "kill_worker", 0.0),
                                                    Fault(5.0, "kill_in_rendezvous", 0.6)],
               "peers forming a round with a worker that died"),
        _named("3-every-holder-dies", THREE, [Fault(5.0, "kill_node", 0.0),
                                              Fault(5.0, "kill_node", 0.5),
                                              Fault(5.0, "kill_node", 0.99)],
               "every state holder dies: the job stops with ElasticStateLost"),
        _named("4-killed-worker-in-a-ring", TWO_MIN, [Fault(5.0, "kill_worker", 0.4)],
               "a killed worker: every rank fails at once (the engine side is a real test)"),
        _named("5-raylet-dies", THREE, [Fault(5.0, "raylet", 0.3)],
               "a worker whose raylet died with it"),
        _named("6-commit-race", THREE, [Fault(5.0, "kill_in_commit", 0.0)],
               "a peer lost at a commit (the sampler's union is a real test)"),
        _named("7-recovery-while-newcomer-starts", THREE, [
            Fault(4.0, "slow_start", 0.0, 20.0), Fault(4.0, "add_node", 0.0),
            Fault(5.0, "kill_worker", 0.5)],
            "a failure while a replacement worker is still starting"),
        _named("8-9-faults-before-first-commit", THREE, [
            Fault(0.5, "kill_worker", 0.2), Fault(1.0, "kill_worker", 0.2),
            Fault(1.5, "kill_in_sync", 0.2)],
            "faults before the first commit (the soak's own checks are real tests)"),
        _named("10-drain-on-forming-round", THREE, [
            Fault(4.0, "slow_start", 0.0, 6.0), Fault(4.0, "add_node", 0.0),
            Fault(5.0, "drain_in_rendezvous", 0.0, 30.0)],
            "a drain lands on a round still forming"),
        _named("11-12-newcomer-held-back", TWO_MIN, [
            Fault(4.0, "add_node", 0.0), Fault(4.5, "drain_in_rendezvous", 0.2, 30.0),
            Fault(9.0, "drain", 0.1, 5.0)],
            "a given-up round's newcomer, and newcomers asked over before a commit"),
        _named("13-14-partition-longer-than-timeout", THREE, [
            Fault(5.0, "partition", 0.0, 3.0), Fault(15.0, "partition", 0.0, 14.0)],
            "a 3 s then a 14 s partition of rank 0's host"),
        _named("15-drain-gives-round-up", TWO_MIN, [
            Fault(4.0, "add_node", 0.0), Fault(4.2, "slow_start", 0.0, 3.0),
            Fault(5.0, "drain_in_rendezvous", 0.9, 30.0)],
            "a drain gives a round up while a newcomer makes its groups"),
        _named("16-partition-near-timeout", THREE, [Fault(5.0, "partition", 0.5, 14.0)],
               "a partition just over the collective timeout"),
        _named("17-raylet-killed-workers-exit", THREE, [Fault(5.0, "raylet", 0.0),
                                                        Fault(5.5, "kill_worker", 0.9)],
               "a raylet killed: its workers exit with it"),
        _named("18-drained-member-late-to-rendezvous", THREE, [
            Fault(5.0, "drain", 0.0, -1.0), Fault(5.05, "partition", 0.0, 1.0)],
            "a drained member reaches the rendezvous after its peers formed the round"),
        _named("drained-only-holder", WorldConfig(nodes=1, slots=1, max_nodes=3,
                                                  min_workers=1, max_workers=2),
               [Fault(3.0, "add_node", 0.0), Fault(8.0, "drain", 0.0, -1.0)],
               "the only worker holding the state drains while a newcomer joins"),
        # Found by the simulator (shrunk by Hypothesis from random schedules; the seed is
        # the world's: start delays, launch delays and Ray's timings)
        _named("drained-holder-kept", replace(THREE, nodes=6, max_nodes=6, max_workers=4,
                                              timeout_s=5.0, commit_s=1.0), [
            [3.737, "kill_in_sync", 0.6622, 0.0], [7.256, "drain_in_rendezvous", 0.0931, 0.102],
            [37.38, "kill_in_commit", 0.4821, 0.0], [44.419, "drain_kill", 0.2132, 3.746]],
            "kills and drains leave one holder, on a draining node: it stays until a staying "
            "worker has synced", seed=31),
        _named("drained-last-round-waited", replace(
            THREE, nodes=6, slots=2, max_nodes=8, max_workers=6, commit_s=1.0,
            late_placed_s=(0.0, 1.1889184614648347)), [
            [175.402, "node_kill_in_connect", 0.9621, 0.0],
            [175.521, "partition", 0.743, 14.268], [184.229, "drain_in_rendezvous", 0.3692, 3.391]],
            "a round left all on draining nodes is waited for, not formed beside", seed=107),
        _named("slow-node-last-resort", replace(
            THREE, nodes=6, max_nodes=10, min_workers=2, commit_s=0.2), [
            [81.431, "slow_start", 0.2729, 38.878], [105.703, "drain_kill", 0.5999, 0.793],
            [110.137, "slow_start", 0.5551, 33.392], [116.675, "kill_node", 0.6169, 0.0]],
            "nodes that cannot start workers sort first: the job must still use the others",
            seed=706),
        _named("last-holder-spared", replace(
            THREE, nodes=4, max_nodes=5, min_workers=2, max_workers=6, commit_s=1.0), [
            [7.739, "drain_kill", 0.4568, 3.279], [8.918, "raylet", 0.067, 0.0],
            [13.846, "add_node", 0.4144, 0.0], [15.344, "partition", 0.1823, 32.132],
            [22.22, "node_kill_in_connect", 0.8864, 0.0], [23.85, "kill_node", 0.9036, 0.0],
            [32.23, "kill_worker", 0.21, 0.0], [37.089, "raylet", 0.2678, 0.0],
            [43.886, "kill_worker", 0.4596, 0.0], [43.993, "partition", 0.0402, 3.723]],
            "after a partition the only holder's join is held: it is waited for, not "
            "restarted", seed=117),
        _named("given-up-round-trains-on", replace(THREE, max_nodes=7, max_workers=4,
                                                   timeout_s=5.0, commit_s=1.0), [
            [3.168, "add_node", 0.9134, 0.0], [7.402, "drain_kill", 0.7418, 1.461],
            [16.415, "drain_in_rendezvous", 0.9022, 0.124], [16.671, "kill_node", 0.1691, 0.0],
            [19.957, "kill_node", 0.866, 0.0], [27.85, "drain", 0.0148, -1.0],
            [29.025, "partition", 0.6083, 3.711], [29.305, "drain", 0.388, -1.0]],
            "a drain gives up a round past its store waits: the round trains on to its "
            "first commit, and the next round waits for it", seed=530),
        _named("newcomer-holds-the-state", replace(
            THREE, nodes=2, max_nodes=3, autoscaler=False, respawn=False), [
            Fault(3.0, "add_node"), Fault(15.0, "kill_node", 0.0),
            Fault(15.0, "kill_node", 0.0)],
            "a worker that joined and synced holds the state: both older workers' nodes die "
            "and the job goes on with it from the committed step"),
        _named("synced-newcomer-kept", replace(THREE, max_workers=7, commit_s=1.0), [
            [5.15, "kill_worker", 0.18, 0.0], [5.30, "drain", 0.8213, -1.0]],
            "a drain gives up a round whose veteran died unseen: its newcomers synced the "
            "state and are its only copy; they are not restarted", seed=49701),
        _named("other-holder-asked", replace(
            THREE, nodes=5, slots=2, max_nodes=6, max_workers=8), [
            [64.289, "drain", 0.4384, -1.0], [88.002, "partition", 0.2002, 2.766],
            [88.24, "drain", 0.6238, 13.207], [89.785, "kill_node", 0.3251, 0.0],
            [93.405, "kill_node", 0.6623, 0.0]],
            "held joins after a partition are restarted only when another holder answers "
            "a ping now: the one that answered the last heartbeat had just lost its node",
            seed=85470),
        _named("late-placed-answer", replace(
            THREE, nodes=1, commit_s=6.0, start_s=(1.0, 1.0), autoscaler=False,
            respawn=False, late_placed_s=(1.0, 2.0)), [
            Fault(2.0, "add_node"), Fault(13.4, "add_node")],
            "a loaded machine: a newcomer placed after waiting for the next commit hears of "
            "its place late, while the next newcomer already waits: it is not held back"),
        # found with instant control actors: its timing needs calls that take no time
        _named("placed-member-not-stuck", replace(
            THREE, nodes=4, slots=2, max_nodes=6, max_workers=8, late_placed_s=(0.0, 1.911),
            store_call_s=0.0, join_call_s=0.0), [
            [5.631, "kill_in_rendezvous", 0.0506, 0.0], [8.661, "kill_worker", 0.9652, 0.0],
            [56.377, "kill_node", 0.5232, 0.0], [62.161, "drain_in_rendezvous", 0.3887, 2.067],
            [67.955, "kill_in_rendezvous", 0.6007, 0.0], [68.417, "partition", 0.3392, 40.221]],
            "a member absent from the rendezvous before a round placed it hears of its place "
            "late: its absence counts from the round, and it is not restarted as stuck",
            seed=19794),
        _named("synced-holder-heard-by-heartbeat", replace(
            THREE, max_nodes=3, min_workers=2, commit_s=0.2, late_placed_s=(0.0, 0.829)), [
            [6.451, "kill_in_commit", 0.4618, 0.0],
            [12.224, "node_kill_in_rendezvous", 0.3231, 0.0],
            [19.006, "drain_kill", 0.3264, 4.001], [21.236, "kill_in_commit", 0.4827, 0.0],
            [28.04, "partition", 0.5895, 2.496]],
            "a newcomer syncs the state, its round never commits and its peer dies while a "
            "partition holds its next join: the heartbeat says it holds the state, and it is "
            "spared", seed=57782),
        _named("slow-node-not-forgotten", replace(THREE, slots=2, max_nodes=6, max_workers=4,
                                                  commit_s=0.2), [
            [6.094, "kill_in_rendezvous", 0.9073, 0.0], [72.361, "partition", 0.6178, 34.258],
            [74.781, "slow_start", 0.7322, 32.28], [97.311, "slow_start", 0.594, 35.522],
            [121.254, "add_node", 0.3545, 0.0], [142.235, "drain", 0.2557, -1.0],
            [168.832, "drain", 0.7022, 13.825]],
            "two nodes whose workers never start in time: each stays a last resort until a "
            "worker starts there, so the job starts its workers on the node that can",
            seed=133193),
        _named("draining-members-replaced", replace(
            THREE, nodes=5, slots=2, max_nodes=8, min_workers=2, commit_s=1.0,
            late_placed_s=(0.0, 1.727)), [
            [34.021, "slow_start", 0.3704, 21.743], [67.323, "drain", 0.1145, 13.696],
            [87.905, "node_kill_in_connect", 0.657, 0.0], [105.364, "drain", 0.1257, -1.0],
            [109.369, "kill_node", 0.0045, 0.0], [116.342, "slow_start", 0.5198, 28.948],
            [123.386, "drain", 0.4349, -1.0], [155.954, "drain", 0.9577, -1.0]],
            "every member is on a draining node, kept for the state, and they fill "
            "max_workers: replacements start up to min_workers staying ones and take the "
            "state over", seed=107684),
        _named("starts-spread-off-unproven-node", replace(
            THREE, slots=2, max_nodes=3, min_workers=2, timeout_s=5.0, commit_s=0.2,
            late_placed_s=(0.0, 0.921)), [
            [6.308, "kill_node", 0.9937, 0.0], [15.091, "node_kill_in_rendezvous", 0.7456, 0.0],
            [18.383, "stuck_start", 0.0968, 0.0], [27.472, "add_node", 0.0533, 0.0],
            [28.351, "kill_worker", 0.4369, 0.0], [34.778, "stuck_start", 0.8376, 0.0],
            [47.081, "drain", 0.2205, -1.0]],
            "new nodes whose workers never start: a replacement goes to a node with no start "
            "under way before one with one, so each such node holds up one start at a time "
            "and the job starts on the node that can", seed=150375),
        _named("starts-one-per-unproven-node", replace(
            THREE, nodes=5, slots=2, max_nodes=8, min_workers=2, timeout_s=5.0,
            commit_s=0.5), [
            [121.622, "stuck_start", 0.1841, 0.0], [185.556, "drain", 0.6367, -1.0],
            [185.669, "drain", 0.2673, -1.0], [203.114, "stuck_start", 0.565, 0.0],
            [234.321, "partition", 0.7103, 16.054]],
            "both holders' nodes drain; their replacements went two at a time to a node "
            "whose starts never end, then to another: ElasticTimeout with a free node "
            "never tried. A node no worker started on takes one start before any takes a "
            "second", seed=129),
        _named("last-resorts-take-turns", replace(
            THREE, nodes=5, max_nodes=8, min_workers=2, commit_s=1.0,
            late_placed_s=(0.0, 0.8757), checkpoint_every_s=5.0, storage_write_s=(0.1, 2.228)),
            [[3.286, "stuck_start", 0.5066, 0.0], [5.163, "drain_kill", 0.2663, 1.254],
             [9.229, "add_node", 0.3331, 0.0], [11.581, "kill_node", 0.684, 0.0],
             [21.357, "drain_in_rendezvous", 0.5778, 1.35],
             [42.243, "drain_in_rendezvous", 0.9056, 2.234],
             [43.536, "stuck_start", 0.5808, 0.0], [60.073, "add_node", 0.479, 0.0],
             [62.7, "drain_kill", 0.2934, 2.455], [72.161, "kill_in_commit", 0.8427, 0.0],
             [75.111, "kill_worker", 0.8461, 0.0], [81.495, "drain_kill", 0.6156, 0.791],
             [90.222, "kill_worker", 0.4157, 0.0], [91.871, "partition", 0.258, 32.059],
             [93.28, "kill_worker", 0.5234, 0.0], [99.118, "kill_in_rendezvous", 0.3409, 0.0],
             [106.592, "kill_in_commit", 0.9153, 0.0], [110.971, "lose_everything", 0.0, 0.0],
             [111.259, "kill_in_sync", 0.3766, 0.0], [114.88, "kill_in_sync", 0.6733, 0.0],
             [122.894, "drain", 0.9847, 1.807], [136.451, "kill_in_commit", 0.7639, 0.0],
             [139.296, "add_node", 0.2953, 0.0], [139.907, "kill_in_sync", 0.3565, 0.0],
             [145.515, "node_kill_in_rendezvous", 0.6032, 0.0]],
            "two nodes whose starts never end and a third whose one start died with every "
            "worker at once: the last resorts took turns in node id order and the third "
            "was never tried again. The one given up on longest ago goes first",
            seed=23891),
        _named("hedged-start-below-minimum", replace(
            THREE, nodes=6, slots=2, max_nodes=7, min_workers=2, timeout_s=5.0,
            commit_s=0.5, checkpoint_every_s=5.0, storage_write_s=(0.1, 3.922)),
            [[5.289, "stuck_start", 0.0786, 0.0], [9.226, "drain_kill", 0.3225, 3.808],
             [13.331, "add_node", 0.1981, 0.0], [24.649, "slow_start", 0.972, 36.985],
             [42.757, "lose_everything", 0.0, 0.0], [47.241, "kill_worker", 0.4452, 0.0],
             [49.158, "lose_everything", 0.0, 0.0], [52.686, "drain", 0.946, 6.09],
             [54.676, "kill_node", 0.2322, 0.0], [76.499, "kill_node", 0.1288, 0.0]],
            "one worker left, below min_workers, while its two replacements wait on a node "
            "whose starts hang and then on one whose starts are slow: they held the whole "
            "max_workers room until start_timeout_s, the free slot beside the survivor "
            "idled and the job ran out its elastic_timeout. A start waiting past half of "
            "start_timeout_s is hedged on another node", seed=71724),
        _named("hedges-keep-slow-starts", replace(
            THREE, nodes=6, slots=2, max_nodes=7, min_workers=2, timeout_s=5.0,
            commit_s=0.5, checkpoint_every_s=5.0, storage_write_s=(0.1, 3.922)),
            [[5.289, "stuck_start", 0.0786, 0.0], [9.226, "drain_kill", 0.3225, 3.808],
             [24.649, "slow_start", 0.972, 36.985], [49.158, "lose_everything", 0.0, 0.0],
             [52.686, "drain", 0.946, 6.09], [125.064, "drain", 0.321, -1.0],
             [128.623, "node_kill_in_rendezvous", 0.2254, 0.0],
             [133.871, "kill_in_commit", 0.7671, 0.0], [153.918, "add_node", 0.461, 0.0],
             [218.128, "partition", 0.8251, 31.748], [233.84, "slow_start", 0.811, 22.356],
             [243.127, "drain_kill", 0.1084, 0.974],
             [249.336, "node_kill_in_rendezvous", 0.4282, 0.0]],
            "every worker lost; the only nodes left start workers slowly (22 s) or never: "
            "each hedge gave up a slow start seconds before it would have joined, and the "
            "job never formed a round again. Stale starts are given up for a hedge only "
            "once the job has min_workers", seed=71724),
        _named("joins-queued-at-a-slow-rounds-actor", SLOW_ROUNDS_ACTOR, [
            Fault(20.0, "kill_worker", 0.3), Fault(40.0, "drain", 0.6, -1.0),
            Fault(60.0, "add_node", 0.0)],
            "256 workers whose joins the rounds actor lists 20 ms apart (5 s for a round): a "
            "join that reached it is listed before the driver's next call is answered, so "
            "the driver takes no unlisted join for one Ray holds back and restarts no one"),
    ]
    return {x.name: x for x in [*s, *durable_scenarios()]}


# 32 nodes of 8 slots, the rounds actor 40 times slower than measured on a 2-core head
SLOW_ROUNDS_ACTOR = WorldConfig(nodes=32, slots=8, max_nodes=36, min_workers=1,
                                max_workers=288, timeout_s=30.0, commit_s=2.0,
                                autoscaler=False, respawn=False, join_call_s=0.02)


# a job writing a durable checkpoint every second, each write taking 0.2-0.5 s
DURABLE = replace(THREE, checkpoint_every_s=1.0, storage_write_s=(0.2, 0.5))


def durable_scenarios() -> list[Schedule]:
    """Durable checkpoints: the floor under the in-memory state."""
    return [
        _named("durable-whole-job-lost", DURABLE, [Fault(10.0, "lose_everything")],
               "every worker lost at once: the next round restores the latest complete "
               "durable checkpoint and the job goes on from it"),
        _named("durable-storage-down-then-job-lost", DURABLE, [
            Fault(6.0, "storage_outage", 0.0, 24.0), Fault(14.0, "lose_everything")],
            "storage down while the job trains (its writes fail, training goes on), then "
            "every worker lost: the round that restores waits for storage, and the "
            "checkpoint from before the outage is restored"),
        _named("durable-none-complete-yet", replace(DURABLE, checkpoint_every_s=30.0),
               [Fault(8.0, "lose_everything")],
               "every worker lost before the first checkpoint was complete: the job stops "
               "with ElasticStateLost, as without checkpoints"),
        _named("durable-writer-lost-mid-write", replace(DURABLE, storage_write_s=(2.5, 3.0)),
               [Fault(9.0, "kill_worker", 0.0), Fault(9.5, "lose_everything")],
               "rank 0 lost while it wrote a checkpoint (never complete), then every "
               "worker: the one before is restored"),
        _named("durable-whole-pool-drain", replace(
            DURABLE, checkpoint_every_s=30.0, launch_s=(6.0, 8.0)),
            [Fault(40.0, "drain_pool", 0.0, 3.0)],
            "every node of the job drains at once with a 3 s deadline, too short for a "
            "replacement to start and sync: the driver asks rank 0 for a checkpoint at its "
            "next commit, and the job restores it, not the one from 10 s before"),
        _named("durable-pool-drains-node-by-node", replace(
            DURABLE, nodes=2, max_nodes=3, max_workers=2, autoscaler=False, respawn=False,
            checkpoint_every_s=60.0),
            [Fault(6.0, "drain", 0.0, 20.0), Fault(9.0, "drain", 0.99, 20.0),
             Fault(40.0, "add_node", 0.0)],
            "the pool's nodes drain one after the other, nowhere to go: the last holder "
            "trains on in one round (not a round per commit), the driver asks rank 0 for a "
            "checkpoint, and a node added after the pool went restores it"),
        _named("durable-driver-killed", DURABLE, [
            Fault(8.0, "kill_driver", 0.0, 5.0), Fault(9.0, "kill_node", 0.5),
            Fault(20.0, "kill_driver", 0.0, 1.0)],
            "the driver process killed (its workers end with it) and the same command run "
            "5 s later, a node lost while no driver runs, then the second driver killed: "
            "each new driver's first round restores the latest complete checkpoint"),
        _named("scripted-discovery-fails-and-recovers", replace(
            THREE, scripted_discovery=True, autoscaler=False), [
            Fault(5.0, "discovery_outage", 0.0, 40.0), Fault(8.0, "kill_node", 0.0),
            Fault(30.0, "add_node")],
            "the discovery script fails on every run for 40 s while a node dies and another "
            "joins: its last hosts stand (a start on the dead node fails), the job trains on, "
            "and the new node is used once the script answers again"),
        _named("scripted-host-leaves-discovery", replace(
            THREE, scripted_discovery=True, autoscaler=False, slots=2, max_workers=8), [
            Fault(8.0, "undiscover", 0.0, 20.0)],
            "the discovery script stops listing a host with two workers for 20 s: both leave "
            "at the next commit (no restore, no blacklist), the job trains on with the other "
            "hosts and takes the host back when the script lists it again; max_workers is "
            "above the slots listed, so starts under way must count against their slots"),
        _named("scripted-failure-blacklists-the-host", replace(
            THREE, scripted_discovery=True, autoscaler=False, slots=2, max_workers=6,
            cooldown_range=(5.0, 20.0)), [Fault(8.0, "kill_worker", 0.0)],
            "a worker fails on a host with two: Horovod's blacklist takes the whole host out, "
            "so its other worker leaves at the next commit too; the host comes back after "
            "its cooldown"),
        _named("durable-control-actors-killed", DURABLE, [
            Fault(8.0, "kill_control", 0.0), Fault(20.0, "kill_control", 0.9)],
            "the head's rounds actor dies, later the store actor: each time the driver ends "
            "every worker and starts the job again, with new ones, from the latest checkpoint"),
        _named("control-actor-killed-without-checkpoints", THREE, [
            Fault(8.0, "kill_control", 0.0)],
            "the rounds actor dies in a job without durable checkpoints: it stops with "
            "ControlActorLost, which says to give the job a checkpoint"),
        _named("durable-damaged-write-skipped", replace(DURABLE, storage_write_s=(0.2, 0.3)),
               [Fault(6.0, "storage_damage", 0.4), Fault(8.5, "lose_everything")],
               "a checkpoint lands with a byte flipped at its size: its writer reads its part "
               "back and gives the write up, pruning nothing for it; every worker then lost: "
               "the newest intact checkpoint is restored"),
        _named("durable-bit-rot-found-as-read", DURABLE,
               [Fault(9.3, "storage_rot"), Fault(9.5, "lose_everything")],
               "the newest checkpoint damaged where it lies, long after it was written and "
               "read back; every worker then lost: the ranks find the damage as they read it, "
               "set it aside and restore the intact one before"),
        _named("durable-stale-writer-fenced", replace(DURABLE, storage_write_s=(2.5, 3.0)),
               [Fault(8.0, "kill_driver", 0.9, 0.2), Fault(20.0, "lose_everything")],
               "the driver killed while rank 0 writes, its writer going on; the same command "
               "run 0.2 s later takes the lease: the old writer's manifest is refused, and no "
               "checkpoint of the new run is pruned for it"),
        _named("durable-late-renewal-after-takeover",
               replace(DURABLE, storage_write_s=(2.5, 3.0)),
               [Fault(8.0, "kill_driver", 0.9, 0.2), Fault(20.0, "lose_everything")],
               "the driver killed, its rank 0 going on; the same command run 0.2 s later "
               "takes the lease, then the old run's renewal (checked before the takeover) "
               "lands: the new run still holds the lease, its checkpoints complete"),
        _named("durable-lost-twice", DURABLE, [
            Fault(8.0, "lose_everything"), Fault(20.0, "lose_everything"),
            Fault(21.0, "kill_node", 0.5)],
            "every worker lost twice, and a node soon after the second restore"),
    ]

