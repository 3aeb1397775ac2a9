"""What a simulated elastic job's world is made of: its settings, its nodes, its worker
processes and the rendezvous rounds as the workers see them (plain data; `world.World`
runs them on its clock)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

RPC_S = 0.002  # one call to an actor on a reachable node
# the store calls a round's member makes to meet its peers: its address, and its two ring
# neighbours' for its first allreduce (gloo pairs connect when first used)
STORE_CALLS_PER_MEMBER = 3


@dataclass
class WorldConfig:
    """One simulated job's cluster and settings (drawn from the seed)."""

    nodes: int = 3
    slots: int = 1  # workers per node
    max_nodes: int = 6  # the autoscaler adds nodes up to this
    min_workers: int = 1
    max_workers: int = 3
    timeout_s: float = 10.0  # the collective and rendezvous timeout
    commit_s: float = 0.5  # training time between commits
    start_s: tuple[float, float] = (0.5, 3.0)  # a worker process's start
    launch_s: tuple[float, float] = (2.0, 8.0)  # the autoscaler's node launch
    start_timeout_s: float = 30.0
    elastic_timeout: float = 60.0
    cooldown_range: tuple[float, float] = (2.0, 10.0)
    autoscaler: bool = True
    respawn: bool = True  # without an autoscaler, a lost node's replacement joins
    # how long a group's connect holds its members when a peer died after publishing its
    # address (None: timeout_s, raytrain-x's bound; torch's own tries took 5 x timeout_s)
    connect_wait_s: float | None = None
    # a loaded machine: the rounds actor's answer to a join reaches its worker this many
    # seconds after the round is published (None: at once, one call's time)
    late_placed_s: tuple[float, float] | None = None
    # durable checkpoints (`CheckpointConfig`): rank 0 marks a commit for writing every this
    # many seconds (None: the job has none); a write takes `storage_write_s`, fails while
    # storage is down, and never completes if rank 0's process ends before it does
    checkpoint_every_s: float | None = None
    storage_write_s: tuple[float, float] = (0.2, 3.0)
    # hosts come from a discovery script (`ScriptDiscovery`): it reports the nodes that are
    # up with their total slots, and fails on every run while discovery is down
    scripted_discovery: bool = False
    # the store actor serves one call at a time, each taking this long (measured with
    # `benchmarks/control_plane.py --round` on a 2-core machine: 3 x 4,096 store calls in
    # 9.8 s): a round's formation grows with its size
    store_call_s: float = 0.0008
    # the rounds actor lists one join at a time, each taking this long (the same
    # benchmark: 4,096 joins in 2.2 s)
    join_call_s: float = 0.0005


@dataclass
class Node:
    node_id: str
    slots: int
    up: bool = True  # its processes run (False once killed or terminated)
    known_dead: bool = False  # Ray has declared it dead (gone from its alive nodes)
    cut_until: float = -math.inf  # partitioned until then
    raylet_dead: bool = False
    drain_deadline: float | None = None  # draining since a drain (inf: no deadline)
    slow_starts: tuple[float, float] | None = None  # worker starts take this long
    stuck_starts: bool = False  # worker processes never start

    def cut(self, now: float) -> bool:
        return now < self.cut_until


@dataclass
class Group:
    """One rendezvous round as the workers see it."""

    round_id: int
    ranks: dict[str, int]  # worker id -> rank
    hosts_version: int
    arrived: set[str] = field(default_factory=set)
    phase: str = "rendezvous"  # rendezvous, connect, sync, training, broken, done
    stalled_since: float | None = None  # a member is cut off since
    restore_from_storage: bool = False  # the driver found no holder: restore the checkpoint
    restore_checkpoint: tuple[int, int] | None = None  # the one it named (None: the latest)
    commit_due: bool = False  # a commit is scheduled
    store: int = 0  # the store actor its keys go to (each job's control actors have one)
    order: list[str] | None = None  # the worker at each position of its sharded layout


class SimWorker:
    """One worker actor and its process."""

    def __init__(self, key: int, node: Node) -> None:
        self.key = key
        self.node = node
        self.worker_id = ""  # given by the pool when it joins the job
        self.alive = True  # its process runs
        self.ready_at: float | None = None  # its process answers from then (None: never)
        self.outcome: tuple[str, Any] | None = None  # ("finished"|"failed"|"left", value)
        self.outcome_at = math.inf  # when the driver can see the outcome
        self.group: Group | None = None
        self.phase = "idle"  # idle, joining, rendezvous, sync, training, done
        self.joining_since: float | None = None
        self.join_arrived = False
        self.join_arrived_at = -math.inf
        self.join_attempt = 0  # its joins so far (a queued join listed only if the latest)
        self.placed_in: int | None = None  # the round its join was given, heard or not
        self.sent_away = False  # the driver sent it away (its node drains), heard or not
        self.holds = False  # synced the job's state in some round
        self.state_round = 0  # the round of the state it holds (what it reports at joins)
        self.step = 0  # its state: commits it includes
        self.saved = 0  # its last saved commit
        self.restores = 0
        self.restarted = False  # the driver killed it, the state's last holder, running

    def reachable(self, now: float) -> bool:
        return self.alive and not self.node.cut(now) and not self.node.raylet_dead

    def __repr__(self) -> str:
        return f"{self.worker_id or f'actor{self.key}'}@{self.node.node_id}"
