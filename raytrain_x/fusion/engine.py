"""The background engine: negotiate ready tensors, fuse them, run one collective per batch.

A cycle (paced by `cycle_time_ms` while work keeps arriving; the first request after an
idle spell starts one at once):
  1. take newly enqueued requests;
  2. one allreduce(BAND) of [status word, response-cache bits]: in steady state this alone
     tells every rank which cached names are ready everywhere (slot order, identical);
  3. only if some rank has an uncached request, a stall, a join or a knob change: one
     allgather of reports, fed to the replicated `Coordinator`;
  4. `plan_batches` fuses same-key allreduces up to the fusion threshold; each batch is
     packed by the native core into a persistent buffer, reduced once and unpacked;
  5. knob changes from rank 0's report apply at the end of the cycle on every rank.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from raytrain_x import _native
from raytrain_x.comm.groups import ProcessGroups, ProcessSet
from raytrain_x.common.errors import (
    ConfigError,
    InternalError,
    RaytrainXError,
    TensorMismatchError,
)
from raytrain_x.common.knobs import Knobs
from raytrain_x.fusion.buffers import FusionBufferPool, pack, unpack
from raytrain_x.fusion.coordinator import Coordinator, Report
from raytrain_x.fusion.messages import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BARRIER,
    BROADCAST,
    DTYPE_SIZES,
    REDUCESCATTER,
    Meta,
    Request,
    Response,
)
from raytrain_x.fusion.planner import plan_batches
from raytrain_x.fusion.shm import SHM_DTYPES, open_host_group, open_local_group
from raytrain_x.fusion.timeline import Timeline

log = logging.getLogger("raytrain_x.engine")

# Status word bits, set when all is quiet so that a bitwise AND across ranks tells if any
# rank needs more than the cache fast path.
_NOTHING_TO_REPORT = 1
_NOT_SHUTTING_DOWN = 2
_NO_MESSAGE = 4
_JOINED = 8
_IDLE_WAKE_S = 0.05  # an idle engine still cycles this often so peers are never held long


@dataclass
class EngineStats:
    """Counters the autotuner scores samples with (bytes and seconds per collective)."""

    bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    steps: int = 0  # cycles that ran at least one collective
    cycles: int = 0
    negotiations: int = 0  # cycles that needed the allgather of reports

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
    """

    def __init__(
        self,
        groups: ProcessGroups,
        knobs: Knobs,
        timeline_path: str | None = None,
        stall_warning_s: float = 60.0,
        stall_shutdown_s: float = 0.0,
    ) -> None:
        self.groups = groups
        self.rank = groups.rdv.rank
        self.size = groups.rdv.size
        self.knobs = knobs
        self.stats = EngineStats()
        self._cache = _native.ResponseCache(knobs.cache_capacity)
        self._cache_version = 0  # bumped whenever entries may have changed
        self._coordinator = Coordinator(self._members_of, stall_shutdown_s)
        self._buffers = FusionBufferPool()
        # Single-host worlds reduce through shared memory (opened collectively, now); in
        # multi-host worlds each host's ranks share memory for hierarchical allreduce.
        self._shm = open_host_group(groups, groups.rdv.timeout_s)
        self._local_shm = (open_local_group(groups, groups.rdv.timeout_s)
                           if self._shm is None and self.multi_level() else None)
        self._stall_warning_s = stall_warning_s
        self._timeline = Timeline(timeline_path) if timeline_path and self.rank == 0 else None
        self._cond = threading.Condition()
        self._queue: list[Request] = []
        self._inflight: set[str] = set()
        self._pending: dict[str, Request] = {}
        self._requested_knobs: Knobs | None = None
        # (cycle at whose end the knobs took effect, knobs), oldest first; cycle 0 = start.
        self._knob_history: list[tuple[int, Knobs]] = [(0, knobs)]
        self._knob_listeners: list[Callable[[Knobs], None]] = []
        self._cycle_hooks: list[Callable[[Knobs, int, list[Response]], None]] = []
        self._shutdown_requested = False
        self._join_handle = None
        self._join_state = "none"  # none -> requested -> reported (joined)
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
            self._join_state = "requested"
            self._cond.notify()

    def request_knobs(self, knobs: Knobs) -> None:
        """Asks for new knobs; rank 0's request is applied on all ranks at one cycle."""
        with self._cond:
            self._requested_knobs = knobs
            self._cond.notify()

    def on_knobs_changed(self, listener: Callable[[Knobs], None]) -> None:
        self._knob_listeners.append(listener)

    def knobs_before(self, cycle: int) -> Knobs:
        """The knobs in effect for work done after cycle `cycle` began: the latest switch
        that took effect at the end of an earlier cycle. Every rank gets the same answer for
        the same cycle number (cycles are lockstep), whatever its own thread has seen since,
        so a framework can rebuild per-knob structures (gradient buckets) at a step that
        every rank agrees on."""
        with self._cond:
            history = list(self._knob_history)
        for applied_at, knobs in reversed(history):
            if applied_at < cycle:
                return knobs
        return history[0][1]

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
            self.groups.close()
            self.groups.rdv.store = None
            self._shm = self._local_shm = None

    @property
    def transport(self) -> str:
        """'shm' when allreduces of the world go through shared memory; 'gloo+shm' when the
        world spans hosts (gloo) and each host's ranks share memory for the local stages of
        hierarchical allreduce (when that knob is on); else 'gloo'."""
        if self._shm is not None:
            return "shm"
        return "gloo+shm" if self._local_shm is not None else "gloo"

    @property
    def error(self) -> BaseException | None:
        return self._error

    def _raise_if_stopped(self) -> None:
        if self._error is not None:
            raise self._error
        if self._stopped.is_set():
            raise InternalError("raytrain-x has been shut down; call init() again first")

    def _members_of(self, process_set_id: int) -> list[int]:
        return self.groups.process_set(process_set_id).ranks

    # ----------------------------------------------------------------- engine thread
    def _has_work(self) -> bool:
        return bool(self._queue or self._pending or self._shutdown_requested
                    or self._join_state != "none" or self._requested_knobs)

    def _loop(self) -> None:
        last = 0.0
        busy = False  # work was waiting when the last cycle ended
        try:
            while True:
                with self._cond:
                    if not self._has_work():
                        self._cond.wait(_IDLE_WAKE_S)
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
                exc = InternalError(f"the raytrain-x engine failed: {exc!r}")
            self._error = exc
            for shm in (self._shm, self._local_shm):
                if shm is not None:
                    shm.abort()  # peers waiting on this host fail now, not at the timeout
        finally:
            self._stop()

    def _stop(self) -> None:
        with self._cond:
            self._stopped.set()
            leftovers = list(self._pending.values()) + self._queue
            self._pending.clear()
            self._queue.clear()
            self._inflight.clear()
        error = self._error or InternalError(
            "raytrain-x was shut down (on this or another rank) while this collective was "
            "pending; make every rank finish its collectives before shutdown()")
        for req in leftovers:
            req.handle.set_error(error)
        if self._join_handle is not None and not self._join_handle.done():
            self._join_handle.set_error(error)

    def _cycle(self) -> bool:
        """Runs one cycle; returns True when the engines should stop."""
        start = time.perf_counter()
        with self._cond:
            new, self._queue = self._queue, []
            shutting_down = self._shutdown_requested
            knobs_wanted = self._requested_knobs if self.rank == 0 else None
            join_state = self._join_state
        for req in new:
            self._pending[req.name] = req
        self.stats.cycles += 1

        now = time.monotonic()
        stalled = {}
        for name, req in self._pending.items():
            age = now - req.enqueued_at
            if age > self._stall_warning_s and now - req.stall_reported_at > self._stall_warning_s:
                stalled[name] = age
                req.stall_reported_at = now
        joined = join_state == "reported"
        cached = [n for n, r in self._pending.items() if self._cache_matches(r)]
        to_report = [r for n, r in self._pending.items() if not r.reported and n not in cached]
        has_message = bool(stalled or knobs_wanted or join_state == "requested")

        status = _NOT_SHUTTING_DOWN if not shutting_down else 0
        status |= _NOTHING_TO_REPORT if not to_report else 0
        status |= _NO_MESSAGE if not has_message else 0
        status |= _JOINED if joined else 0
        names_for_bits = self._cache.lru_order() if joined else cached
        words = self._cache.bits(names_for_bits)
        vector = np.empty(1 + len(words), dtype=np.uint64)
        vector[0] = status
        vector[1:] = words
        self._world_allreduce(torch.from_numpy(vector.view(np.int64)), "band")
        agreed = int(vector[0])
        all_joined = bool(agreed & _JOINED)

        responses: list[Response] = []
        if not all_joined and len(words):
            bits = vector[1:].tolist()
            for entry in self._cache.entries_for_bits(bits):
                name = entry["name"]
                self._cache.get(name)  # same LRU touch on every rank
                req = self._pending.get(name)  # its meta matched the entry: reuse it
                responses.append(Response(name, req.meta if req is not None
                                          else Meta.from_cache(entry)))
            self._coordinator.forget([r.name for r in responses])

        new_knobs = None
        if not (agreed & _NOTHING_TO_REPORT and agreed & _NO_MESSAGE):
            new_knobs = self._negotiate(responses, stalled, knobs_wanted, join_state)
        negotiated = time.perf_counter()
        if all_joined:
            self._finish_join()

        if responses and self._timeline is not None:
            for r in responses:
                req = self._pending.get(r.name)
                if req is not None:
                    self._timeline.record(r.name, "NEGOTIATE", start, negotiated)
        for batch in plan_batches(responses, self.knobs.fusion_threshold_bytes):
            self._execute(batch)
        if responses:
            self.stats.steps += 1
            for hook in list(self._cycle_hooks):
                try:
                    hook(self.knobs, self.stats.steps, responses)
                except Exception:  # noqa: BLE001 - a tuning failure must not stop training
                    log.exception("raytrain-x: a cycle hook failed and was removed")
                    self._cycle_hooks.remove(hook)
        if new_knobs is not None:
            self._apply_knobs(new_knobs)
        return not agreed & _NOT_SHUTTING_DOWN

    def _cache_matches(self, req: Request) -> bool:
        if req.meta.kind != ALLREDUCE or self._cache.capacity == 0:
            return False
        if req.cache_checked == self._cache_version:  # asked before, cache unchanged since
            return req.cache_hit
        entry = self._cache.peek(req.name)
        req.cache_hit = entry is not None and Meta.from_cache(entry) == req.meta
        req.cache_checked = self._cache_version
        return req.cache_hit

    def _negotiate(self, responses: list[Response], stalled: dict[str, float],
                   knobs_wanted: Knobs | None, join_state: str) -> Knobs | None:
        self.stats.negotiations += 1
        ready = {r.name for r in responses}
        report = Report(rank=self.rank, stalled=stalled,
                        knobs=knobs_wanted.to_dict() if knobs_wanted else None,
                        join=join_state == "requested")
        for name, req in self._pending.items():
            if not req.reported and name not in ready:
                report.requests.append((name, req.meta))
                req.reported = True
        blobs = self.groups.world.allgather_bytes(pickle.dumps(report))
        decision = self._coordinator.process([pickle.loads(b) for b in blobs])
        for r in decision.responses:
            if r.error:
                self._cache.erase(r.name)
            elif r.meta.kind == ALLREDUCE and self._cache.capacity:
                self._cache.put(r.name, r.meta.dtype, list(r.meta.shape), r.meta.cache_key())
        self._cache_version += 1
        responses.extend(decision.responses)
        if self.rank == 0:
            for text in decision.warnings:
                log.warning(text)
        if report.join:
            with self._cond:
                self._join_state = "reported"
        if knobs_wanted is not None:
            with self._cond:
                if self._requested_knobs is knobs_wanted:
                    self._requested_knobs = None
        return Knobs(**decision.knobs) if decision.knobs else None

    def _finish_join(self) -> None:
        last = self._coordinator.joined[-1] if self._coordinator.joined else self.rank
        self._coordinator.joined = []
        with self._cond:
            handle, self._join_handle, self._join_state = self._join_handle, None, "none"
        if handle is not None:
            handle.set_result(last)

    def _apply_knobs(self, knobs: Knobs) -> None:
        if knobs.cache_capacity != self.knobs.cache_capacity:
            self._cache = _native.ResponseCache(knobs.cache_capacity)
            self._cache_version += 1
        self.knobs = knobs
        with self._cond:
            # A step's last collective is at most a few cycles old when it asks, so a short
            # history suffices; the starting knobs stay first (knobs_before(0)).
            self._knob_history = [self._knob_history[0], *self._knob_history[1:][-30:],
                                  (self.stats.cycles, knobs)]
        for listener in self._knob_listeners:
            listener(knobs)

    # ----------------------------------------------------------------- execution
    def _execute(self, batch: list[Response]) -> None:
        first = batch[0]
        requests = [self._pending.pop(r.name, None) for r in batch]
        results: list[Any] = [None] * len(batch)
        error: BaseException | None = None
        try:
            if first.error:
                error = TensorMismatchError(first.error)
                return
            pset = self.groups.process_set(first.meta.process_set_id)
            if not pset.included():
                return
            run = {ALLREDUCE: self._allreduce, ALLGATHER: self._allgather,
                   BROADCAST: self._broadcast, ALLTOALL: self._alltoall,
                   REDUCESCATTER: self._reducescatter, BARRIER: self._barrier}[first.meta.kind]
            began = time.perf_counter()
            results = run(batch, requests, pset)
            self.stats.add(first.meta.kind, sum(r.meta.nbytes_on_wire() for r in batch),
                           time.perf_counter() - began)
            if self._timeline is not None:
                for req in requests:
                    if req is not None:
                        self._timeline.record(req.name, "QUEUE", _perf_from_mono(req.enqueued_at),
                                              began)
        except BaseException as exc:
            error = exc if isinstance(exc, RaytrainXError) else InternalError(
                f"the raytrain-x engine failed: {exc!r}")
            raise
        finally:
            # Names leave the in-flight set before their handles complete: a caller that
            # wakes up and submits the same name again (every training step does) must
            # never find it still in flight.
            with self._cond:
                for r in batch:
                    self._inflight.discard(r.name)
            for req, result in zip(requests, results):
                if req is not None:
                    req.handle.cycle = self.stats.cycles
                    if error is not None:
                        req.handle.set_error(error)
                    else:
                        req.handle.set_result(result)

    def _allreduce(self, batch: list[Response], requests: list[Request | None],
                   pset: ProcessSet) -> list[Any]:
        meta = batch[0].meta
        tensors = [req.tensor if req is not None else _zeros(r.meta)
                   for r, req in zip(batch, requests)]
        floating = tensors[0].is_floating_point()
        reduce_op = "sum" if meta.op in ("sum", "average") else meta.op
        scaled = meta.op in ("sum", "average")
        pre = meta.prescale if scaled else 1.0
        post = meta.postscale if scaled else 1.0
        if meta.op == "average" and floating:
            post /= pset.size()
        wire = meta.wire_dtype or meta.dtype
        row = batch[0].name if len(batch) == 1 else f"fused[{len(batch)}]"
        if len(tensors) == 1 and wire == meta.dtype:
            t = tensors[0]
            if pre != 1.0:
                t.mul_(pre)
            self._timed(row, "ALLREDUCE", lambda: self._reduce(t, reduce_op, pset))
            if post != 1.0:
                t.mul_(post)
        elif (self._shm is not None and pset.process_set_id == 0 and wire == meta.dtype
              and all(_fits_shm(t) for t in tensors)):
            # Fused straight through the shared slots: no fusion-buffer copies.
            self._timed(row, "ALLREDUCE", lambda: self._shm_call(
                self._shm.allreduce_many, tensors, reduce_op, pre, post))
        elif tensors[0].device.type == "cpu":
            total = sum(t.numel() for t in tensors)
            buf = self._buffers.get(wire, total * DTYPE_SIZES[wire])
            names = [r.name for r in batch]
            self._timed(row, "MEMCPY_IN_FUSION_BUFFER", lambda: pack(tensors, buf, pre, 0, names))
            flat = torch.from_dlpack(buf.view(total))
            self._timed(row, "ALLREDUCE", lambda: self._reduce(flat, reduce_op, pset))
            self._timed(row, "MEMCPY_OUT_FUSION_BUFFER",
                        lambda: unpack(buf, tensors, post, 0, names))
        else:  # CUDA: the native core packs host memory, so fuse with torch on the device
            flat = torch.cat([t.reshape(-1) for t in tensors]).to(getattr(torch, wire))
            if pre != 1.0:
                flat.mul_(pre)
            self._reduce(flat, reduce_op, pset)
            offset = 0
            for t in tensors:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view_as(t))
                offset += n
            if post != 1.0:
                for t in tensors:
                    t.mul_(post)
        if meta.op == "average" and not floating:
            for t in tensors:
                t.div_(pset.size(), rounding_mode="floor")
        return [None if req is None else req.output if req.output is not None else req.tensor
                for req in requests]

    def _world_allreduce(self, t: torch.Tensor, op: str) -> None:
        """In-place allreduce over the world: shared memory when possible, else gloo."""
        if self._shm is not None and _fits_shm(t):
            self._shm_call(self._shm.allreduce, t, op)
        else:
            self.groups.world.allreduce(t, op)

    @staticmethod
    def _shm_call(fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except RuntimeError as exc:
            raise InternalError(
                f"allreduce failed: {exc}. A peer process probably died or stalled; "
                "elastic jobs restore the last commit, others should be restarted."
            ) from exc

    def _reduce(self, t: torch.Tensor, op: str, pset: ProcessSet) -> None:
        if self._shm is not None and pset.process_set_id == 0:
            self._world_allreduce(t, op)
        elif (self.knobs.hierarchical_allreduce and op == "sum" and pset.process_set_id == 0
                and self.multi_level()):
            self._hierarchical_allreduce(t)
        else:
            pset.group.allreduce(t, op)

    def multi_level(self) -> bool:
        """True when the world has several hosts with several workers each (the case
        hierarchical collectives are for)."""
        rdv = self.groups.rdv
        return rdv.cross_size > 1 and rdv.local_size > 1 and self.groups.homogeneous()

    def _hierarchical_allreduce(self, t: torch.Tensor) -> None:
        """Local reduce-scatter, cross allreduce of the shard, local allgather. With
        shared memory on this host: local allreduce and shard exchange in the segment.
        Shards are the same on every host either way (the cross allreduce pairs them)."""
        local, cross = self.groups.local, self.groups.cross
        flat = t.reshape(-1)
        pad = (-flat.numel()) % local.size
        shm = self._local_shm
        if shm is not None and _fits_shm(t):
            work = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat
            n = work.numel() // local.size
            self._shm_call(shm.allreduce, work, "sum")
            cross.allreduce(work[local.rank * n:(local.rank + 1) * n], "sum")
            self._shm_call(shm.allgather_shards, work)
            if pad:
                flat.copy_(work[: flat.numel()])
            return
        work = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat.clone()
        shard = work.new_empty(work.numel() // local.size)
        local.reduce_scatter(shard, work)
        cross.allreduce(shard, "sum")
        local.allgather(list(work.chunk(local.size)), shard)
        flat.copy_(work[: flat.numel()])

    def _allgather(self, batch, requests, pset):
        (resp,), (req,) = batch, requests
        dims = list(resp.rank_dims)
        tensor = req.tensor
        longest = max(dims)
        padded = tensor
        if tensor.shape[0] != longest:
            padded = tensor.new_zeros((longest, *tensor.shape[1:]))
            padded[: tensor.shape[0]] = tensor
        outs = [padded.new_empty(padded.shape) for _ in dims]
        if (self.knobs.hierarchical_allgather and pset.process_set_id == 0
                and self.multi_level()):
            self._hierarchical_allgather(outs, padded.contiguous())
        else:
            self._timed(resp.name, "ALLGATHER",
                        lambda: pset.group.allgather(outs, padded.contiguous()))
        return [torch.cat([o[:d] for o, d in zip(outs, dims)])]

    def _hierarchical_allgather(self, outs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        """Allgather within the host, then exchange whole host blocks across hosts."""
        local, cross = self.groups.local, self.groups.cross
        local_outs = [tensor.new_empty(tensor.shape) for _ in range(local.size)]
        local.allgather(local_outs, tensor)
        block = torch.stack(local_outs)
        blocks = [block.new_empty(block.shape) for _ in range(cross.size)]
        cross.allgather(blocks, block)
        for host_block, global_rank in zip(blocks, cross.ranks):
            host = self.groups.layout[global_rank][1]
            host_ranks = [r for r, (_, c) in enumerate(self.groups.layout) if c == host]
            for piece, r in zip(host_block, host_ranks):
                outs[r].copy_(piece)

    def _broadcast(self, batch, requests, pset):
        (resp,), (req,) = batch, requests
        root = pset.ranks.index(resp.meta.root)
        self._timed(resp.name, "BROADCAST", lambda: pset.group.broadcast(req.tensor, root))
        return [req.output if req.output is not None else req.tensor]

    def _alltoall(self, batch, requests, pset):
        (resp,), (req,) = batch, requests
        me = pset.rank()
        in_splits = list(resp.rank_dims[me])
        out_splits = [splits[me] for splits in resp.rank_dims]
        output = req.tensor.new_empty((sum(out_splits), *req.tensor.shape[1:]))
        self._timed(resp.name, "ALLTOALL",
                    lambda: pset.group.alltoall(output, req.tensor, out_splits, in_splits))
        return [(output, torch.tensor(out_splits, dtype=torch.int32))]

    def _reducescatter(self, batch, requests, pset):
        (resp,), (req,) = batch, requests
        meta = resp.meta
        work = req.tensor.clone()
        if meta.prescale != 1.0:
            work.mul_(meta.prescale)
        self._timed(resp.name, "REDUCESCATTER", lambda: pset.group.allreduce(work, "sum"))
        n, dim0 = pset.size(), work.shape[0]
        sizes = [dim0 // n + (1 if i < dim0 % n else 0) for i in range(n)]
        me = pset.rank()
        out = work[sum(sizes[:me]): sum(sizes[: me + 1])].clone()
        post = meta.postscale / (n if meta.op == "average" else 1)
        if out.is_floating_point():
            out.mul_(post)
        elif meta.op == "average":
            out.div_(n, rounding_mode="floor")
        return [out]

    def _barrier(self, batch, requests, pset):
        return [None]  # negotiation itself was the rendezvous of every member

    def _timed(self, row: str, activity: str, fn: Callable[[], Any]) -> Any:
        if self._timeline is None:
            return fn()
        began = time.perf_counter()
        out = fn()
        self._timeline.record(row, activity, began, time.perf_counter())
        return out


def _fits_shm(t: torch.Tensor) -> bool:
    """True when the shared-memory group can reduce `t` in place."""
    return t.device.type == "cpu" and t.dtype in SHM_DTYPES and t.is_contiguous()


def _zeros(meta: Meta) -> torch.Tensor:
    """A joined rank's contribution to an allreduce it did not submit."""
    return torch.zeros(meta.shape, dtype=getattr(torch, meta.dtype),
                       device="cuda" if meta.device == "cuda" else "cpu")


_MONO_TO_PERF = time.perf_counter() - time.monotonic()


def _perf_from_mono(t: float) -> float:
    return t + _MONO_TO_PERF
