"""The default reducer: gradients allreduced in units while backward runs. The units are
`gradient_layout`'s (the runs of an arena, cut at the fusion threshold knob, or fixed
buckets).

How they go: a gradient's hook counts it ready in its unit; the unit goes to the engine
the moment its last gradient is ready, so communication starts with the first gradients
and keeps pace with backward, and crosses the wire as it is (the engine agrees on its
readiness and its route, and fuses or cuts nothing the face formed). Autotune moves the
threshold; every rank cuts its runs again at the same step, by the knobs in effect when
that rank's last unit was agreed (`Engine.knobs_at`). A unit's first request in a world is
checked and described as any allreduce's; its next ones reuse that description and go
straight to the engine. Sparse gradients (`nn.Embedding(sparse=True)`) leave their unit at
their first arrival and go on their own.
"""

from __future__ import annotations

from typing import Any

import torch

from raytrain_x.common.knobs import Knobs
from raytrain_x.core import runtime
from raytrain_x.core.collectives import predivided
from raytrain_x.engine.engine import Engine
from raytrain_x.engine.messages import Handle, Meta, Request
from raytrain_x.torch.async_ops import (
    CompositeHandle,
    allreduce_async_,
    allreduce_request,
    sparse_allreduce_async,
)
from raytrain_x.torch.compression import Compressor
from raytrain_x.torch.grad_sync import GradientSync, Reducer
from raytrain_x.torch.gradient_layout import GradientLayout, GradientRun, Unit, explicit_groups


class AllreduceReducer(Reducer):
    """Allreduce (`op` Average or Sum) of each unit as its last gradient is ready.

    Args:
        op: `Average` or `Sum`.
        predivide: Horovod's `gradient_predivide_factor`.
        compression: the wire's compressor.
        bucket_cap_mb: fixed buckets of this size (None or 0: runs of the arena).
        groups: Horovod's `groups` (an int, or lists of parameters).
        sparse_as_dense: sparse gradients reduced dense.
    """

    arrivals = True
    warns_unskipped = True

    def __init__(self, op: str, predivide: float, compression: type[Compressor],
                 bucket_cap_mb: float | None, groups: Any, sparse_as_dense: bool) -> None:
        self._op = op
        self._predivide = predivide
        self._compression = compression
        self._cap_mb = bucket_cap_mb
        self._groups = groups
        self._sparse_as_dense = sparse_as_dense
        self._handles: dict[Unit | torch.Tensor, Handle] = {}  # by unit, or sparse parameter
        # the engine this world's units go to, and each unit's agreed description there
        self._engine: Engine | None = None
        self._described: dict[Unit, tuple[str, Meta]] = {}
        self._scaled = ("", 1.0, 1.0)  # (op, prescale, postscale) in this world
        self._step_began = False
        self._agreed_cycle = -1  # the cycle the last step's last unit was agreed in

    def bind(self, core: GradientSync) -> None:
        super().bind(core)
        params = core.reduced_params
        self._unprobed = set(params)  # a first gradient tells whether it is sparse
        cap = int(self._cap_mb * 2**20) if self._cap_mb else 0
        self.layout = GradientLayout(params, core.gradient_names,
                                     explicit_groups(self._groups, params))
        # cut at the knobs at hand (asking nothing of an engine, which may have failed
        # already: its error belongs to the step), and again at the first step at the
        # engine's first knobs, the same on every rank
        knobs = runtime.last_knobs() or Knobs()
        self.layout.build(cap, knobs.fusion_threshold_bytes)
        runtime.note_gradient_batching(self.layout.fixed)

    @property
    def cap_bytes(self) -> int:
        return self.layout.cap_bytes

    def _world(self) -> Engine:
        """The engine of this world (a new one after an elastic reset, or init() again,
        and with it the units' descriptions and scaling made again)."""
        engine = self._engine
        if engine is None or engine.stopped:
            engine = self._engine = runtime.engine()
            self._described.clear()
            self._scaled = predivided(self._op, self._predivide, self.core.process_set.size())
            self._agreed_cycle = -1  # this engine's first knobs
        return engine

    def _begin_step(self) -> None:
        """A step's first unit is about to form: the runs are cut at the fusion threshold
        in effect when the last step's last unit was agreed (on every rank the same)."""
        self._step_began = True
        threshold = self._world().knobs_at(self._agreed_cycle).fusion_threshold_bytes
        if not self.layout.fixed and threshold != self.layout.unit_bytes:
            self.layout.cut(threshold)
            self._described.clear()

    # ------------------------------------------------------------------ backward
    def arriving(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """A parameter's first gradient leaves the flat buffers if it is sparse (its unit
        goes now if it was waiting for this gradient alone); an arena gradient set to None
        by `zero_grad()` gets its view back, zeroed, so it accumulates there in place."""
        if p in self._unprobed:
            self._unprobed.discard(p)
            if grad.is_sparse:
                unit = self.layout.make_sparse(p)
                if unit is not None and unit.params and unit not in self._handles:
                    self._send_if_complete(unit)
        if p.grad is None:
            unit = self.layout.unit_of.get(p)
            if isinstance(unit, GradientRun):
                unit.arena.attach_zeroed(p)

    def ready(self, p: torch.Tensor) -> None:
        if not self._step_began:
            self._begin_step()
        unit = self.layout.unit_of.get(p)
        if unit is None:
            self._handles[p] = self._allreduce_grad(p)
            return
        unit.ready += 1
        self._send_if_complete(unit)

    def _send_if_complete(self, unit: Unit) -> None:
        if unit.ready >= len(unit.params):
            unit.ready = 0
            self._handles[unit] = self._allreduce_unit(unit)

    def busy(self, p: torch.Tensor) -> bool:
        handle = self._handles.get(self.layout.unit_of.get(p, p))
        return handle is not None and not handle.done()

    def in_flight(self) -> bool:
        for key in [k for k, h in self._handles.items() if h.done()]:
            del self._handles[key]  # a failed world's, after an elastic reset
        return bool(self._handles)

    def forget(self) -> None:
        self._handles.clear()
        for unit in self.layout.units:
            unit.ready = 0
        self._step_began = False

    # ------------------------------------------------------------------ reductions
    def _allreduce_unit(self, unit: Unit) -> Handle:
        """A bucket or a run of the arena, its gradients pointed at their views first: one
        request the engine reduces as it is. Its first in a world goes through
        `allreduce_async_`'s checks; the next ones reuse the description."""
        unit.attach()
        engine = self._world()  # a new one if the world ended within this step
        described = self._described.get(unit)
        if described is None:
            op, pre, post = self._scaled
            request, handle = allreduce_request(unit.flat, None, unit.name, op, pre, post,
                                                self.core.process_set, self._compression,
                                                fuse=False)
            if handle is request.handle:  # not one a compressor's handle decompresses
                self._described[unit] = (request.name, request.meta)
        else:
            name, meta = described
            flat = unit.flat
            request = Request(name, meta, flat, Handle(name), flat, contiguous=True)
            handle = request.handle
        engine.enqueue(request)
        return handle

    def _allreduce_grad(self, p: torch.Tensor) -> Handle:
        """A gradient outside every unit: a sparse one, or zeros where none came."""
        if p.grad is None:  # no gradient this step: zeros, as Horovod sends
            p.grad = torch.zeros_like(p)
        name = f"grad.{self.core.gradient_names[p]}"
        op, pre, post = self._scaled
        pset = self.core.process_set
        if not p.grad.is_sparse:
            return allreduce_async_(p.grad, name=name, op=op, prescale_factor=pre,
                                    postscale_factor=post, process_set=pset,
                                    compression=self._compression)
        if self._sparse_as_dense:  # densified, reduced, and made sparse again
            inner = allreduce_async_(p.grad.to_dense(), name=name, op=op, prescale_factor=pre,
                                     postscale_factor=post, process_set=pset,
                                     compression=self._compression)
            handle = CompositeHandle(name, [inner], lambda out: out[0].to_sparse())
        else:  # as Horovod: an allgather of indices and values whose duplicates sum up
            handle = sparse_allreduce_async(p.grad, name, self._op, pset)
        return _Replacing(handle, p)

    def synchronize(self) -> None:
        if not self._step_began:
            self._begin_step()
        for p in self.core.reduced_params:  # outside every unit (sparse), no hook fired
            if p not in self._handles and p not in self.layout.unit_of:
                self._handles[p] = self._allreduce_grad(p)
        for unit in self.layout.units:  # units some of whose gradients never came
            if unit not in self._handles:
                self._handles[unit] = self._allreduce_unit(unit)
        for handle in list(self._handles.values()):
            handle.wait()
        self._agreed_cycle = max((h.cycle for h in self._handles.values()), default=-1)

    def zero_grad(self, set_to_none: bool) -> bool:
        """Gradients in fixed buckets stay views of their buffers (zeroed, never None), as
        with DDP's gradient_as_bucket_view; the others find their place in the arena again
        when backward brings the next one, zeroed there just before it is added."""
        self.layout.zero(set_to_none)
        return self.layout.holds_all()


class _Replacing(Handle):
    """Waits for a gradient's reduction and puts the result in `p.grad` (sparse paths,
    whose result is a new tensor rather than the gradient reduced in place)."""

    __slots__ = ("_inner", "_param")

    def __init__(self, inner: Handle, param: torch.Tensor) -> None:
        super().__init__(inner.name)
        self._inner, self._param = inner, param

    def done(self) -> bool:
        return self._inner.done()

    @property
    def cycle(self) -> int:  # type: ignore[override]
        return getattr(self._inner, "cycle", -1)

    @cycle.setter
    def cycle(self, value: int) -> None:
        pass

    def wait(self, timeout: float | None = None) -> Any:
        result = self._inner.wait(timeout)
        self._param.grad = result
        return result
