"""The default reducer: gradients allreduced in units while backward runs.

A gradient's hook counts it ready in its unit (a run of neighbouring gradients in the
arena, or a fixed bucket); the unit goes to the engine the moment its last gradient is
ready, and the engine fuses whatever is ready in a cycle up to the fusion threshold
(Horovod's dynamic fusion, so communication starts with the first gradients and keeps pace
with backward). Where the gradients live and which travel together is `gradient_layout`'s.
Sparse gradients (`nn.Embedding(sparse=True)`) leave their unit at their first arrival and
go on their own.
"""

from __future__ import annotations

from typing import Any

import torch

from raytrain_x.core import runtime
from raytrain_x.core.collectives import predivided, synchronize
from raytrain_x.engine.messages import Handle
from raytrain_x.torch.async_ops import CompositeHandle, allreduce_async_, sparse_allreduce_async
from raytrain_x.torch.compression import Compressor
from raytrain_x.torch.grad_sync import GradientSync, Reducer
from raytrain_x.torch.gradient_layout import (
    GradientBuffer,
    GradientLayout,
    GradientRun,
    explicit_groups,
)

Unit = GradientBuffer | GradientRun


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

    def bind(self, core: GradientSync) -> None:
        super().bind(core)
        params = core._requires_update
        self._unprobed = set(params)  # a first gradient tells whether it is sparse
        cap = int(self._cap_mb * 2**20) if self._cap_mb else 0
        self.layout = GradientLayout(params, core.gradient_names,
                                     explicit_groups(self._groups, params))
        self.layout.build(cap)
        if self.layout.fixed:
            runtime.note_fixed_buckets()

    @property
    def cap_bytes(self) -> int:
        return self.layout.cap_bytes

    def _scales(self) -> tuple[str, float, float]:
        return predivided(self._op, self._predivide, self.core._process_set.size())

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

    # ------------------------------------------------------------------ reductions
    def _allreduce_unit(self, unit: Unit) -> Handle:
        """A bucket (reduced alone) or a run of the arena (the engine may fuse it with the
        runs ready beside it), its gradients pointed at their views first."""
        op, pre, post = self._scales()
        unit.attach()
        return allreduce_async_(unit.flat, name=unit.name, op=op, prescale_factor=pre,
                                postscale_factor=post, process_set=self.core._process_set,
                                compression=self._compression, fuse=unit.fuse)

    def _allreduce_grad(self, p: torch.Tensor) -> Handle:
        """A gradient outside every unit: a sparse one, or zeros where none came."""
        if p.grad is None:  # no gradient this step: zeros, as Horovod sends
            p.grad = torch.zeros_like(p)
        name = f"grad.{self.core.gradient_names[p]}"
        op, pre, post = self._scales()
        pset = self.core._process_set
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
        for p in self.core._requires_update:  # outside every unit (sparse), no hook fired
            if p not in self._handles and p not in self.layout.unit_of:
                self._handles[p] = self._allreduce_grad(p)
        for unit in self.layout.units:  # units some of whose gradients never came
            if unit not in self._handles:
                self._handles[unit] = self._allreduce_unit(unit)
        for handle in list(self._handles.values()):
            synchronize(handle)

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
