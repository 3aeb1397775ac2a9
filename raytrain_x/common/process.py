"""This process's state, in one object.

`PROCESS` holds everything raytrain-x keeps in a process; no other module keeps state of
its own between calls (the registries of array types and backends hold code, not state;
tests/unit/test_process_state.py walks every module). It sits in `common`, the lowest
layer, so that every layer keeps its state here. Its `world` is what `init()` makes: the
engine, the knobs the user fixed, rank 0's autotune sampler and the numbering of unnamed
collectives. An elastic reset replaces it whole, so a worker that joins a running job and
the veterans start the new round alike (the unnamed collectives of the round are numbered
from 0 on every rank). The rest lives as long as the process: what drives it (the elastic
driver's probe, the autotune controller's client), what the job told it (the batch size),
its training steps, its tuning record and its elastic history, and what it serves and
runs (the job's store, the metrics export, the TensorFlow face's kernels).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raytrain_x.autotune.sampler import Advisor, AutotuneSampler
    from raytrain_x.comm.rendezvous import Rendezvous
    from raytrain_x.common.autotune_config import AutotuneConfig
    from raytrain_x.common.knobs import Knobs
    from raytrain_x.engine.engine import Engine

    AdvisorFactory = Callable[[AutotuneConfig, Knobs, frozenset], Advisor]


class StepClock:
    """Counts training steps (the marks `mark_step` sets) and keeps the latest durations
    between marks (`core.status` reads them), and this rank's own work in each step of the
    current world: the step's duration less the time the stepping thread was blocked
    waiting for collectives (`blocked`). A synchronous step lasts as long on every rank,
    the slowest's; the others wait for it, so the work tells which rank that is (the
    elastic driver's heartbeat carries it to its policies)."""

    def __init__(self, keep: int = 1024, keep_work: int = 64) -> None:
        self.steps = 0
        self._last: float | None = None
        self._durations: deque[float] = deque(maxlen=keep)
        self._work: deque[float] = deque(maxlen=keep_work)
        self._blocked = 0.0  # seconds the stepping thread waited since the last mark
        self._thread: int | None = None  # the thread that marks steps

    def mark(self) -> None:
        now = time.perf_counter()
        if self._last is not None:
            duration = now - self._last
            self._durations.append(duration)
            self._work.append(max(0.0, duration - self._blocked))
        self._last = now
        self._blocked = 0.0
        self._thread = threading.get_ident()
        self.steps += 1

    def blocked(self, seconds: float) -> None:
        """The calling thread waited `seconds` for a collective (counted when it is the
        thread that marks steps)."""
        if threading.get_ident() == self._thread:
            self._blocked += seconds

    def new_world(self) -> None:
        """A new world began: its steps' work is measured afresh (the re-forming is not a
        step, and the world's size may change each rank's share)."""
        self._work.clear()
        self._last = None
        self._blocked = 0.0

    def recent(self) -> list[float]:
        """The latest step durations, oldest first (the last one ends at step `steps`)."""
        return list(self._durations)

    def work(self) -> tuple[float, int]:
        """(the median of this rank's work per step in this world, in seconds; how many
        steps it is of, at most the last 64): (0.0, 0) before a step was measured."""
        if not self._work:
            return 0.0, 0
        ordered = sorted(self._work)
        return ordered[len(ordered) // 2], len(ordered)


@dataclass
class CheckpointCounters:
    """This rank's durable checkpoints: written (by the rank that completes them), failed
    writes, restores from storage, and the latest of each."""

    written_count: int = 0
    failed_count: int = 0
    restored_count: int = 0
    last_written: int = 0  # the commit number of the last checkpoint written
    last_write_s: float = 0.0
    last_restored: int = 0
    last_restore_s: float = 0.0
    last_checksum_s: float = 0.0  # of the last write: checksumming this rank's files
    last_verify_s: float = 0.0  # and reading the checkpoint back against its checksums

    def written(self, number: int, seconds: float, checksum_s: float = 0.0,
                verify_s: float = 0.0) -> None:
        self.written_count += 1
        self.last_written, self.last_write_s = number, seconds
        self.last_checksum_s, self.last_verify_s = checksum_s, verify_s

    def failed(self, number: int) -> None:
        self.failed_count += 1

    def restored(self, number: int, seconds: float) -> None:
        self.restored_count += 1
        self.last_restored, self.last_restore_s = number, seconds



@dataclass
class World:
    """One round's world: what `init()` makes, and an elastic reset replaces whole."""

    engine: Engine
    fixed_knobs: frozenset[str]  # the knobs the user fixed (autotune leaves them)
    sampler: AutotuneSampler | None = None  # rank 0's, while tuning
    # (collective kind, process set id) -> the next number of an unnamed collective
    names: dict[tuple[str, int], itertools.count] = field(default_factory=dict)
    # the torch face's device mesh of this round (`raytrain_x.torch.mesh`): (the rank at
    # each position, the mesh, its group's store), made on torch's default process group
    mesh: tuple[tuple[int, ...], Any, Any] | None = None


@dataclass
class ProcessState:
    """Everything raytrain-x keeps in this process."""

    world: World | None = None  # None before `init()` and after `shutdown()`
    # what drives this process: rank 0's probe at each commit (the elastic driver's
    # host-set version, whether it asks for a durable checkpoint), and how rank 0 reaches
    # the autotune controller (the executor's actor; else one in this process)
    host_update_probe: Callable[[], tuple[int, bool]] | None = None
    advisor_factory: AdvisorFactory | None = None
    # what the job told it, kept across worlds
    batch_size: int | None = None  # each rank's samples per step (`autotune_batch_size`)
    batching: set[str] = field(default_factory=set)  # how its gradients are batched
    steps: StepClock = field(default_factory=StepClock)  # every round's
    # its latest sampler (the record of the tuning when a reset makes no new one) and the
    # samples of those before it
    latest_sampler: AutotuneSampler | None = None
    retired_samples: list = field(default_factory=list)
    # elastic: how often `run` restored the last commit here, and the round of the state
    # this process holds (0: none; `elastic.state.state_round`)
    restores: int = 0
    state_round: int = 0
    # this rank's durable checkpoints (`raytrain_x.elastic.durable` counts them)
    checkpoints: CheckpointCounters = field(default_factory=CheckpointCounters)
    status_writer: Any = None  # a launched process's status file (`core.status`)
    # how `init()` joins the next round: the executor's actor installs a provider; else
    # the launcher's variables, each `init()` after a `shutdown()` a fresh round of keys
    rendezvous_provider: Callable[[], Rendezvous] | None = None
    env_rounds: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock)
    # numbers that need only differ within this process, by kind (`next_number`): the
    # executors a driver started, TensorFlow's graphs, kernels, tokens and errors, the
    # DistributedOptimizers built without named_parameters
    numbers: dict[str, itertools.count] = field(
        default_factory=lambda: collections.defaultdict(itertools.count))
    # what the Ray face runs in this process: its metrics export (`ray.metrics`), the
    # queue `ray_logger.log` sends to while the executor's function runs, and a Tune
    # trial's worker's session while its function runs (`tune_integration.trainable`)
    metrics_export: Any = None
    log_sink: tuple[Any, bool] | None = None
    tune_session: dict[str, Any] = field(default_factory=dict)
    # the job stores this process serves (rank 0's `comm.job_store`), kept for its life as
    # TCPStore's is, and the timelines its engines wrote (path -> how many engines)
    store_servers: list = field(default_factory=list)
    timelines: dict[str, int] = field(default_factory=dict)
    # warnings given once a process (by name)
    warned: set[str] = field(default_factory=set)
    # held while a variable of os.environ is set for a moment (`comm.torch_backend`)
    environ_lock: threading.Lock = field(default_factory=threading.Lock)
    # what this process read of durable storage's files (`elastic.storage`): bytes and
    # requests; and the thread that hashes a large checkpoint file as it is written
    # (`torch.durable`; a forked child has none)
    storage_bytes_read: int = 0
    storage_reads: int = 0
    hash_thread: Any = None
    # `memory://NAME` storage's files, by NAME (`elastic.storage_schemes`)
    memory_files: dict[str, dict[str, bytes]] = field(default_factory=dict)
    # the TensorFlow face's: its kernels, allreduces in flight and errors
    # (`tensorflow.process.TensorFlowProcess`)
    tensorflow: Any = None


PROCESS = ProcessState()


def next_number(kind: str) -> int:
    """The next of this process's numbers of `kind`, from 0 (`ProcessState.numbers`)."""
    return next(PROCESS.numbers[kind])


def mark_step() -> None:
    """Marks the end of a training step; autotune scores steps between marks, and the
    job's metrics count them. `DistributedOptimizer.step()` calls it; a loop without one
    may call it by hand."""
    PROCESS.steps.mark()
    world = PROCESS.world
    if world is not None and world.sampler is not None:  # rank 0's, while tuning
        world.sampler.mark_step()
