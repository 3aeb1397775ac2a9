"""Fault schedules: random ones drawn from a seed, and the named scenarios of the faults
that real clusters found (docs/elastic.md's findings and the drain-then-kill hang).

A schedule is data (a `WorldConfig` and a list of `Fault`s), so it prints, replays and
shrinks. A fault names its target by a fraction (`pick`) of the candidates it finds when
it fires, so removing one fault leaves the others meaningful."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from raytrain_x.testing.simulation.model import Node, SimWorker, WorldConfig
from raytrain_x.testing.simulation.storage import DAMAGES
from raytrain_x.testing.simulation.world import World

KINDS = ("kill_worker", "kill_node", "drain", "drain_kill", "raylet", "partition",
         "slow_start", "stuck_start", "add_node", "kill_in_rendezvous", "kill_in_sync",
         "kill_in_commit", "node_kill_in_rendezvous", "node_kill_in_connect",
         "drain_in_rendezvous", "storage_outage", "lose_everything", "drain_pool",
         "kill_driver", "discovery_outage", "kill_control", "undiscover")


@dataclass(frozen=True)
class Fault:
    at: float  # virtual seconds from the job's start
    kind: str  # one of KINDS
    pick: float = 0.0  # which target, as a fraction of the candidates
    value: float = 0.0  # the kind's parameter (a deadline, a gap, a duration)

    def __str__(self) -> str:
        return f"{self.at:.2f}s {self.kind} pick={self.pick:.3f} value={self.value:.2f}"


@dataclass(frozen=True)
class Schedule:
    seed: int
    config: WorldConfig
    faults: tuple[Fault, ...]
    name: str = ""
    tail_s: float = 0.0  # quiet time after the last fault before the job is asked to end
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def last_fault(self) -> float:
        return max((f.at for f in self.faults), default=0.0)

    def without(self, keep: list[bool]) -> Schedule:
        return replace(self, faults=tuple(f for f, k in zip(self.faults, keep) if k))

    def describe(self) -> str:
        c = self.config
        head = (f"schedule {self.name or f'seed {self.seed}'}: {c.nodes} nodes x {c.slots} "
                f"slots (autoscaler up to {c.max_nodes}), min_workers={c.min_workers}, "
                f"max_workers={c.max_workers}, timeout_s={c.timeout_s:g}, "
                f"commit every {c.commit_s:g}s"
                + (f", a durable checkpoint every {c.checkpoint_every_s:g}s (writes "
                   f"{c.storage_write_s[0]:g}-{c.storage_write_s[1]:g}s)"
                   if c.checkpoint_every_s is not None else "")
                + (", hosts from a discovery script" if c.scripted_discovery else ""))
        return "\n".join([head, *(f"  {f}" for f in self.faults)])


def random_schedule(seed: int, faults: int = 20, mean_gap_s: float | None = None) -> Schedule:
    """A random cluster, settings and `faults` faults (at least), `mean_gap_s` apart on
    average (default: drawn from 5-20 s, so that some jobs meet their faults in bursts
    and others recover between them), starting once the job has had time to form its
    first round."""
    rng = random.Random(seed)
    if mean_gap_s is None:
        mean_gap_s = rng.uniform(5.0, 20.0)
    slots = rng.choice([1, 1, 2])
    nodes = rng.randint(3, 6)
    max_workers = rng.randint(3, 8)
    config = WorldConfig(
        nodes=nodes, slots=slots, max_nodes=rng.randint(nodes, nodes + 4),
        min_workers=rng.choice([1, 1, 2]) if max_workers > 1 else 1,
        max_workers=max_workers, timeout_s=rng.choice([5.0, 10.0]),
        commit_s=rng.choice([0.2, 0.5, 1.0]), autoscaler=rng.random() < 0.8,
        late_placed_s=_late_placed(seed))
    n = faults + rng.randint(0, faults // 2)
    at = rng.uniform(3.0, 8.0)
    out = []
    weights = {"kill_worker": 3, "kill_node": 2, "drain": 4, "drain_kill": 3, "raylet": 1,
               "partition": 3, "slow_start": 1, "stuck_start": 1, "add_node": 4,
               "kill_in_rendezvous": 2, "kill_in_sync": 2, "kill_in_commit": 2,
               "node_kill_in_rendezvous": 2, "node_kill_in_connect": 2,
               "drain_in_rendezvous": 2}
    kinds, w = list(weights), list(weights.values())
    for _ in range(n):
        kind = rng.choices(kinds, w)[0]
        out.append(Fault(round(at, 3), kind, round(rng.random(), 4),
                         round(_value(kind, rng), 3)))
        at += rng.expovariate(1.0 / mean_gap_s)
    first = out[0].at if out else 3.0
    config, storage_faults = _durable(seed, config, first, at)
    config, discovery_faults = _scripted(seed, config, first, at)
    return Schedule(seed, config, tuple(sorted(out + storage_faults + discovery_faults,
                                               key=lambda f: f.at)))


def _durable(seed: int, config: WorldConfig, first: float, last: float,
             ) -> tuple[WorldConfig, list[Fault]]:
    """Half the jobs write durable checkpoints; they also meet storage outages and the loss
    of every worker at once. Drawn from generators of their own, so the other half's
    schedules are the same as before checkpoints were simulated."""
    rng = random.Random(seed + 3)
    if rng.random() >= 0.5:
        return config, []
    config = replace(config, checkpoint_every_s=rng.choice([0.5, 1.0, 2.0, 5.0]),
                     storage_write_s=(0.1, rng.uniform(0.3, 4.0)))
    faults = [Fault(round(rng.uniform(first, last), 3), "storage_outage", 0.0,
                    round(rng.uniform(1.0, 20.0), 3)) for _ in range(rng.randint(0, 2))]
    faults += [Fault(round(rng.uniform(first, last), 3), "lose_everything")
               for _ in range(rng.randint(1, 2))]
    # a whole-pool spot notice: every node with a worker drains at once, with a deadline
    faults += [Fault(round(rng.uniform(first, last), 3), "drain_pool", 0.0,
                     round(rng.uniform(1.0, 15.0), 3)) for _ in range(rng.randint(0, 1))]
    # the driver process killed (its worker and control actors end with it), the same
    # command run again after `value` seconds (a generator of its own again)
    rng = random.Random(seed + 4)
    faults += [Fault(round(rng.uniform(first, last), 3), "kill_driver", 0.0,
                     round(rng.uniform(1.0, 20.0), 3)) for _ in range(rng.randint(0, 2))]
    return config, faults + _control_kills(seed, first, last)


def _control_kills(seed: int, first: float, last: float) -> list[Fault]:
    """One job in four (of those with checkpoints, which outlive it) loses its rounds or
    its store actor once or twice (a generator of its own)."""
    rng = random.Random(seed + 6)
    if rng.random() >= 0.25:
        return []
    return [Fault(round(rng.uniform(first, last), 3), "kill_control", round(rng.random(), 4))
            for _ in range(rng.randint(1, 2))]


def _scripted(seed: int, config: WorldConfig, first: float, last: float,
              ) -> tuple[WorldConfig, list[Fault]]:
    """One job in three finds its hosts with a discovery script, which fails on every run
    for a while now and then (shorter than `FAILING_FOR_S`: a transient failure), and
    leaves out a host with workers for a while (its workers leave; it comes back). With
    Horovod's hosts, a failed worker takes its host's other workers out with it (the host
    is blacklisted): most such jobs run two workers a node, so that happens."""
    rng = random.Random(seed + 5)
    if rng.random() >= 1 / 3:
        return config, []
    # a cluster its user manages: no autoscaler requests, lost nodes are replaced
    faults = [Fault(round(rng.uniform(first, last), 3), "discovery_outage", 0.0,
                    round(rng.uniform(1.0, 60.0), 3)) for _ in range(rng.randint(0, 2))]
    rng = random.Random(seed + 7)  # the hosts' changes: a generator of their own
    faults += [Fault(round(rng.uniform(first, last), 3), "undiscover", round(rng.random(), 4),
                     round(rng.uniform(2.0, 40.0), 3)) for _ in range(rng.randint(0, 3))]
    slots = rng.choice([config.slots, 2, 2])
    return replace(config, scripted_discovery=True, autoscaler=False, respawn=True,
                   slots=slots, max_workers=max(config.max_workers, slots)), faults


def _late_placed(seed: int) -> tuple[float, float] | None:
    """One job in three runs on a loaded machine, where the rounds actor's answers reach
    their workers up to 2 s late (from a generator of its own: the other draws stay)."""
    rng = random.Random(seed + 2)
    return (0.0, rng.uniform(0.5, 2.0)) if rng.random() < 1 / 3 else None


def _value(kind: str, rng: random.Random) -> float:
    if kind == "drain":
        return rng.choice([-1.0, rng.uniform(1.0, 20.0)])  # -1: no deadline
    if kind in ("drain_kill", "drain_in_rendezvous"):
        return rng.uniform(0.0, 5.0)  # seconds from the drain to the kill
    if kind == "partition":
        return rng.choice([rng.uniform(0.5, 4.0), rng.uniform(5.0, 20.0),
                           rng.uniform(30.0, 45.0)])
    if kind == "slow_start":
        return rng.uniform(8.0, 40.0)
    return 0.0


# ----------------------------------------------------------------------------- applying
def _pick(items: list, pick: float):
    return items[min(int(pick * len(items)), len(items) - 1)] if items else None


def _up_nodes(world: World) -> list[Node]:
    return [n for n in world.nodes.values() if n.up]


def _busy_nodes(world: World) -> list[Node]:
    """Nodes with a worker of the job on them (else any node that is up)."""
    busy = [n for n in _up_nodes(world) if any(w.worker_id for w in world.workers_on(n))]
    return busy or _up_nodes(world)


def _members(world: World) -> list[SimWorker]:
    return [w for w in world.workers if w.alive and w.worker_id]


def _drain_then_kill(world: World, node: Node, gap_s: float) -> None:
    world.drain(node, None)
    world.after(gap_s, lambda: world.kill_node(node))


# faults on a node of the job's (value: each kind's parameter)
NODE_FAULTS = {
    "kill_node": lambda world, node, value: world.kill_node(node),
    "drain": lambda world, node, value: world.drain(node, None if value < 0 else value),
    "drain_kill": _drain_then_kill,
    "raylet": lambda world, node, value: world.kill_raylet(node),
    "partition": lambda world, node, value: world.partition(node, value),
    "undiscover": lambda world, node, value: world.undiscover(node, value),
}


def apply(world: World, fault: Fault) -> None:
    """Carries `fault` out now (phase faults wait for their phase)."""
    kind, pick, value = fault.kind, fault.pick, fault.value
    world.trace(f"FAULT {fault}")
    if kind == "kill_worker":
        w = _pick(_members(world), pick)
        if w is not None:
            world.process_dies(w, visible_in=0.3)
    elif kind in NODE_FAULTS:
        node = _pick(_busy_nodes(world), pick)
        if node is not None:
            NODE_FAULTS[kind](world, node, value)
    elif kind in ("slow_start", "stuck_start"):
        world.next_start = ("stuck" if kind == "stuck_start" else "slow", value)
    elif kind == "add_node":
        if len(_up_nodes(world)) < world.config.max_nodes:
            world.add_node()
    elif kind == "storage_outage":
        world.storage_outage(value)
    elif kind == "lose_everything":
        world.lose_everything()
    elif kind == "drain_pool":
        world.drain_pool(value)
    elif kind == "kill_driver":
        world.writer_outlives = pick >= 0.5  # its rank 0's writer thread goes on
        world.kill_driver(value)
    elif kind == "discovery_outage":
        world.discovery_outage(value)
    elif kind == "kill_control":
        world.kill_control(pick)
    elif kind == "storage_damage":
        world.next_damage = DAMAGES[int(pick * len(DAMAGES)) % len(DAMAGES)]
    elif kind == "storage_rot":  # the newest intact checkpoint damaged where it lies
        world.storage.rot(lambda keys: keys[-1:])
    else:
        phase, what = {
            "kill_in_rendezvous": ("rendezvous", "worker"),
            "kill_in_sync": ("sync", "worker"),
            "kill_in_commit": ("commit", "worker"),
            "node_kill_in_rendezvous": ("rendezvous", "node"),
            "node_kill_in_connect": ("connect", "node"),
            "drain_in_rendezvous": ("rendezvous", "drain_kill"),
        }[kind]
        world.on_phase(phase, lambda members: _phase_fault(world, members, what, pick, value))


def _phase_fault(world: World, members: list[SimWorker], what: str, pick: float,
                 value: float) -> None:
    w = _pick([m for m in members if m.alive], pick)
    if w is None:
        return
    world.trace(f"FAULT fires in its phase on {w}")
    world.fault_times.append(world.now)
    if what == "worker":
        world.process_dies(w, visible_in=0.3)
    elif what == "node":
        world.kill_node(w.node)
    else:
        _drain_then_kill(world, w.node, value)
