"""The background engine: one thread per process that runs every collective in cycles.

A cycle (paced by `cycle_time_ms` while work keeps arriving; the first request after an
idle spell starts one at once) reads:
  1. negotiate: which pending requests every member has submitted (`negotiation`);
  2. plan: the batches (per-tensor allreduces of one key fused up to the fusion
     threshold, a face's unit alone) and their routes (`plan`);
  3. execute: run each batch by the best route (`execution`, `transport`);
  4. knob changes from rank 0's report apply at the end of the cycle on every rank.
This module owns the thread, the queue and the handles; it knows no framework.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from raytrain_x.comm.groups import ProcessGroups, ProcessSetGroup
from raytrain_x.common.errors import (
    ConfigError,
    InternalError,
    RaytrainXError,
    TensorMismatchError,
    drop_tracebacks,
    local_error,
)
from raytrain_x.common.knobs import Knobs
from raytrain_x.engine.execution import CollectiveRunner
from raytrain_x.engine.messages import ALLREDUCE, Request, Response
from raytrain_x.engine.negotiation import (
    JOIN_NONE,
    JOIN_REPORTED,
    JOIN_REQUESTED,
    Agreement,
    Negotiator,
    Speculation,
)
from raytrain_x.engine.plan import LayoutVotes, plan_batches
from raytrain_x.engine.timeline import Timeline
from raytrain_x.engine.transport import PieceStream, Transport

log = logging.getLogger("raytrain_x.engine")

_IDLE_WAKE_S = 0.05  # an idle engine still cycles this often so peers are never held long
KNOB_HISTORY = 64  # knob changes `knobs_at` answers for (autotune: one per sample)


@dataclass
class EngineStats:
    """Counters since the engine started: the autotuner scores samples with bytes and
    seconds per collective; the job's metrics export all of them (`core.status`)."""

    bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    cycles: int = 0
    active_cycles: int = 0  # cycles that ran at least one collective
    negotiations: int = 0  # cycles that needed the allgather of reports
    cache_hits: int = 0  # collectives agreed from the response cache's bits, no report
    speculated: int = 0  # cycles whose batch went with its readiness count (one round trip)
    speculation_misses: int = 0  # speculative cycles some rank was not ready for
    fused: int = 0  # allreduce batches of several tensors
    fused_tensors: int = 0  # ... and the tensors in them
    stalls: int = 0  # stall warnings (a tensor some rank did not submit for a while)
    # ... of which were reduced where they lie (no packing), or crossed a network in pieces
    fused_in_place: int = 0
    in_flight_pieces: int = 0  # pieces those batches crossed a network in

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds


class Engine:
    """One per process; owns the background thread and every in-flight request.

    Args:
        groups: the communicators of this rendezvous round.
        knobs: starting knobs.
        timeline_path: write a Chrome trace here (rank 0 only).
        stall_warning_s: warn when a tensor waits this long for other ranks.
        stall_shutdown_s: fail such a tensor after this long (0 = only warn).
        timeline_mark_cycles: mark each engine cycle that ran a collective in the trace.
    """

    def __init__(
        self,
        groups: ProcessGroups,
        knobs: Knobs,
        timeline_path: str | None = None,
        stall_warning_s: float = 60.0,
        stall_shutdown_s: float = 0.0,
        timeline_mark_cycles: bool = False,
    ) -> None:
        self.groups = groups
        self.rank = groups.rdv.rank
        self.size = groups.rdv.size
        self.knobs = knobs
        # the knobs in effect from each cycle on (the first: this engine's own, the same on
        # every rank), for `knobs_at`
        self._initial_knobs = knobs
        self._knob_history: list[tuple[int, Knobs]] = [(0, knobs)]
        self.stats = EngineStats()
        self._transport = Transport(groups)  # opened collectively, now
        self.hierarchical_allreduce_applies = self._transport.hierarchical_allreduce_applies
        self._negotiator = Negotiator(groups, self._transport.world_allreduce,
                                      knobs.cache_capacity, stall_warning_s, stall_shutdown_s)
        self._timeline = (Timeline(timeline_path, timeline_mark_cycles)
                          if timeline_path and self.rank == 0 else None)
        self._cond = threading.Condition()
        # pieces of batches still crossing a network while the next cycle negotiates: the
        # engine closes each batch on it, drains it before anything else runs, and wakes
        # when a piece lands
        self._stream = PieceStream(wakes=self._cond)
        self._layout = LayoutVotes()
        self._runner = CollectiveRunner(self._transport, self._timeline, self.stats,
                                        self._stream, self._layout)
        # Shared memory answers the status word in microseconds; a network needs a round
        # trip, which speculative cycles save for small batches that repeat every step.
        self._speculation = Speculation(
            self.size > 1 and not self._transport.links(groups.process_set(0)).shm,
            self._runner)
        self._queue: list[Request] = []
        self._inflight: set[str] = set()
        self._pending: dict[str, Request] = {}
        self._requested_knobs: Knobs | None = None
        self._knob_listeners: list[Callable[[Knobs], None]] = []
        self._cycle_hooks: list[Callable[[Knobs, int, list[Response]], None]] = []
        self._shutdown_requested = False
        self._peer_left: InternalError | None = None  # another rank stopped the engines
        self._join_handle = None
        self._join_state = JOIN_NONE
        self._error: BaseException | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="raytrain-x-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- user-thread API
    def enqueue(self, request: Request) -> None:
        """Queues a request; the engine completes its handle."""
        self.enqueue_many([request])

    def enqueue_many(self, requests: list[Request]) -> None:
        """Queues requests atomically: one cycle picks them all up, so a group that is
        ready everywhere is fused together (grouped allreduce)."""
        with self._cond:
            self._raise_if_stopped()
            names = [r.name for r in requests]
            for name in names:
                if name in self._inflight or names.count(name) > 1:
                    raise ConfigError(f"a collective named {name!r} is already in flight; "
                                      "names must be unique until their handle completes")
            self._inflight.update(names)
            self._queue.extend(requests)
            self._cond.notify()

    def join(self, handle: Any) -> None:
        with self._cond:
            self._raise_if_stopped()
            self._join_handle = handle
            self._join_state = JOIN_REQUESTED
            self._cond.notify()

    def request_knobs(self, knobs: Knobs) -> None:
        """Asks for new knobs; rank 0's request is applied on all ranks at one cycle."""
        with self._cond:
            self._requested_knobs = knobs
            self._cond.notify()

    def knobs_at(self, cycle: int) -> Knobs:
        """The knobs in effect during `cycle` (a handle's `cycle`: the same on every rank),
        so that every rank acts on a knob change at the same point of its work; a cycle
        before this engine's first, or older than the history kept, gets its first knobs."""
        for start, knobs in reversed(self._knob_history):
            if start <= cycle:
                return knobs
        return self._initial_knobs

    @property
    def stopped(self) -> bool:
        """True once this engine has stopped (shut down, or failed): a new world's engine
        takes its collectives."""
        return self._stopped.is_set() or self._error is not None

    def on_knobs_changed(self, listener: Callable[[Knobs], None]) -> None:
        self._knob_listeners.append(listener)

    def add_cycle_hook(self, hook: Callable[[Knobs, int, list[Response]], None]) -> None:
        """Runs `hook(knobs, step, responses)` on the engine thread after each cycle that
        completed collectives. A hook that raises is logged and removed; training goes on."""
        self._cycle_hooks.append(hook)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops this engine and, at the same cycle, every peer's."""
        with self._cond:
            self._shutdown_requested = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._timeline is not None:
            self._timeline.close()
        if not self._thread.is_alive():
            # Tear the groups down here, in order, rather than leave them to the garbage
            # collector at interpreter exit (gloo aborted the process there, now and then).
            self._transport.close()

    def start_timeline(self, path: str, mark_cycles: bool = False) -> None:
        """Starts (or moves) rank 0's Chrome trace; other ranks write none."""
        if self.rank != 0:
            return
        current = self._timeline
        if current is not None and current.path == os.fspath(path):
            current.mark_cycles = mark_cycles
            return
        self._timeline = self._runner.timeline = Timeline(path, mark_cycles)
        if current is not None:
            current.close()

    def stop_timeline(self) -> None:
        """Closes rank 0's trace (a complete JSON file); a no-op when none is open."""
        current, self._timeline = self._timeline, None
        self._runner.timeline = None
        if current is not None:
            current.close()

    @property
    def transport(self) -> str:
        """'shm', 'gloo+shm' or 'gloo': see `Transport.name`."""
        return self._transport.name

    def transport_of(self, process_set_id: int) -> str:
        """How a process set's collectives travel: see `Transport.name_of`."""
        return self._transport.name_of(self.groups.process_set(process_set_id))

    def add_process_set(self, ranks: Sequence[int]) -> ProcessSetGroup:
        """Registers a process set (collectively, every rank, same order) and, when its
        members share a host, opens its shared-memory group among them."""
        pset = self.groups.add_process_set(ranks)
        self._transport.open_process_set(pset)
        return pset

    def remove_process_set(self, process_set_id: int) -> None:
        self.groups.remove_process_set(process_set_id)
        self._transport.close_process_set(process_set_id)

    def multi_level(self) -> bool:
        """True when the world has several hosts with several workers each."""
        return self._transport.multi_level()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def _raise_if_stopped(self) -> None:
        if self._error is not None:
            raise self._error
        if self._stopped.is_set():
            if self._peer_left is not None:
                raise self._peer_left
            raise InternalError("raytrain-x has been shut down; call init() again first")

    # ----------------------------------------------------------------- engine thread
    def _has_work(self) -> bool:
        return bool(self._queue or self._pending or self._shutdown_requested
                    or self._join_state != JOIN_NONE or self._requested_knobs)

    def _loop(self) -> None:
        last = 0.0
        busy = False  # work was waiting when the last cycle ended
        try:
            while True:
                self._stream.wait_for_work(self._has_work, _IDLE_WAKE_S)
                # The cycle time paces cycles while work keeps coming (so tensors batch);
                # the first request after an idle spell starts a cycle at once.
                wait = last + self.knobs.cycle_time_ms / 1000.0 - time.perf_counter()
                if busy and wait > 0:
                    time.sleep(wait)
                last = time.perf_counter()
                if self._cycle():
                    break
                with self._cond:
                    busy = self._has_work()
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the handles
            if not isinstance(exc, RaytrainXError):
                log.exception("raytrain-x engine failed")
                exc = local_error(exc)
            self._error = exc
            drop_tracebacks(exc)  # the failed call's frames hold its groups: let them close
            self._transport.abort()  # peers waiting on this rank fail now, not at the timeout
        finally:
            self._stop()

    def _stop(self) -> None:
        with self._cond:
            self._stopped.set()
            leftovers = list(self._pending.values()) + self._queue
            self._pending.clear()
            self._queue.clear()
            self._inflight.clear()
        if self._error is not None:
            error = self._error
        elif self._shutdown_requested:
            error = InternalError(
                "raytrain-x was shut down on this rank while this collective was pending; "
                "make every rank finish its collectives before shutdown()")
        else:  # another rank's engine stopped: most often its script raised or ended
            error = self._peer_left = InternalError(
                "another rank left the job while this collective was pending: its script "
                "raised or ended (the launcher names the rank that failed first and why), "
                "or it called shutdown() before this collective")
        for req in leftovers:
            req.handle.set_error(error)
        self._stream.fail(error)
        if self._join_handle is not None and not self._join_handle.done():
            self._join_handle.set_error(error)

    def _cycle(self) -> bool:
        """Runs one cycle (negotiate -> plan -> execute); returns True when the engines
        should stop."""
        start = time.perf_counter()
        with self._cond:
            new, self._queue = self._queue, []
            shutting_down = self._shutdown_requested
            knobs_wanted = self._requested_knobs if self.rank == 0 else None
            join_state = self._join_state
        for req in new:
            self._pending[req.name] = req
        self.stats.cycles += 1

        quiet = not shutting_down and knobs_wanted is None and join_state == JOIN_NONE
        if self._speculation.expected() is not None and self._speculate(quiet):
            return False
        agreement = self._negotiator.negotiate(self._pending, shutting_down, knobs_wanted,
                                               join_state, self._layout.votes())
        self._layout.settle(agreement.votes)
        if not agreement.all_joined:
            self._speculation.observe(agreement.responses, agreement.all_cached)
        self.stats.negotiations += agreement.reports_exchanged
        self.stats.cache_hits += agreement.cache_hits
        self.stats.stalls += agreement.stalls
        self._note_reported(agreement, knobs_wanted)
        negotiated = time.perf_counter()
        if agreement.all_joined:
            self._stream.drain()
            self._finish_join(agreement.joined_last)
        responses = agreement.responses
        timeline = self._timeline
        if responses and timeline is not None:
            timeline.cycle_start(start)
            for r in responses:
                if r.name in self._pending:
                    timeline.record(r.name, f"NEGOTIATE_{r.meta.kind.upper()}", start,
                                          negotiated)

        plan = plan_batches(responses, self.knobs.fusion_threshold_bytes, agreement.plans)
        for batch in plan:
            self._execute(batch)
        # the last pieces cross on while the engine goes on; those landed finish now
        if agreement.stop:
            self._stream.drain()
        else:
            self._stream.finish_landed()

        if responses:
            self._ran(responses)
        if agreement.knobs is not None:
            self._apply_knobs(agreement.knobs)
        return agreement.stop

    def _ran(self, responses: list[Response]) -> None:
        self.stats.active_cycles += 1
        for hook in list(self._cycle_hooks):
            try:
                hook(self.knobs, self.stats.active_cycles, responses)
            except Exception:  # noqa: BLE001 - a tuning failure must not stop training
                log.exception("raytrain-x: a cycle hook failed and was removed")
                self._cycle_hooks.remove(hook)

    def _speculate(self, quiet: bool) -> bool:
        """Sends the expected batch with this rank's readiness (`negotiation.Speculation`);
        True when every rank was ready and the batch is done."""
        expected = self._speculation.expected()
        began = time.perf_counter()
        outcome = self._speculation.cycle(self._pending, quiet, self.groups.process_set(0),
                                          self.knobs)
        if outcome is None:
            self.stats.speculation_misses += 1
            return False
        requests, results = outcome
        self._negotiator.touch([r.name for r in expected])
        self.stats.speculated += 1
        self._agreed([self._pending.pop(r.name) for r in expected])
        self.stats.add(ALLREDUCE, sum(r.meta.nbytes_on_wire() for r in expected),
                       time.perf_counter() - began)
        self._complete(expected, requests, results, None)
        self._ran(expected)
        return True

    def _note_reported(self, agreement: Agreement, knobs_wanted: Knobs | None) -> None:
        with self._cond:
            if agreement.join_reported:
                self._join_state = JOIN_REPORTED
            if agreement.knobs_sent and self._requested_knobs is knobs_wanted:
                self._requested_knobs = None

    def _finish_join(self, joined_last: int) -> None:
        with self._cond:
            handle, self._join_handle, self._join_state = self._join_handle, None, JOIN_NONE
        if handle is not None:
            handle.set_result(joined_last)

    def _apply_knobs(self, knobs: Knobs) -> None:
        self._negotiator.set_cache_capacity(knobs.cache_capacity)
        self._speculation.reset()
        self.knobs = knobs
        # in effect from the next cycle on, on every rank (applied at the end of this one)
        self._knob_history = [*self._knob_history[-(KNOB_HISTORY - 1):],
                              (self.stats.cycles + 1, knobs)]
        for listener in self._knob_listeners:
            listener(knobs)

    def _execute(self, batch: list[Response]) -> None:
        """Runs one agreed batch and completes its handles (with the error, if it fails)."""
        first = batch[0]
        requests = [self._pending.pop(r.name, None) for r in batch]
        self._agreed(requests)
        results: list[Any] = [None] * len(batch)
        error: BaseException | None = None
        handed = False  # to the stream, which completes the batch
        try:
            if first.error:
                error = TensorMismatchError(first.error)
                return
            # the set's communicator (its `group`: None where this rank is not a member)
            pset = self.groups.sets.get(first.meta.process_set_id)
            if pset is None and not any(requests):
                # a set this rank has yet to register: rank 0 decided it from its members'
                # reports, and this rank is none of them (a member submits after it did)
                return
            if pset is None:
                pset = self.groups.process_set(first.meta.process_set_id)  # raises
            if pset.group is None:
                return
            began = time.perf_counter()
            results = self._runner.run(batch, requests, pset, self.knobs)
            self.stats.add(first.meta.kind, sum(r.meta.nbytes_on_wire() for r in batch),
                           time.perf_counter() - began)
            if self._timeline is not None:
                self._timeline.queued(requests, began)
            # complete once its last pieces have landed (at once when nothing is crossing)
            handed = True
            self._stream.close_batch(
                lambda err: self._complete(batch, requests, results, err))
        except BaseException as exc:
            error = exc if isinstance(exc, RaytrainXError) else local_error(exc)
            raise
        finally:
            if not handed:
                self._complete(batch, requests, results, error)

    def _agreed(self, requests: list[Request | None]) -> None:
        """Marks each handle with the cycle its collective was agreed in (cycles are
        lockstep: the same number on every rank, wherever each rank completes it)."""
        for req in requests:
            if req is not None:
                req.handle.cycle = self.stats.cycles

    def _complete(self, batch: list[Response], requests: list[Request | None],
                  results: list[Any], error: BaseException | None) -> None:
        # Names leave the in-flight set before their handles complete: a caller that
        # wakes up and submits the same name again (every training step does) must
        # never find it still in flight.
        with self._cond:
            for r in batch:
                self._inflight.discard(r.name)
        for req, result in zip(requests, results):
            if req is not None:
                if error is not None:
                    req.handle.set_error(error)
                else:
                    req.handle.set_result(result)
