"""`DistributedOptimizer`: allreduce gradients from backward hooks, wait in `step()`.

A gradient's hook counts it ready in its unit (a run of neighbouring gradients in the
arena, or a fixed bucket); the unit goes to the engine the moment its last gradient is
ready, and the engine fuses whatever is ready in a cycle up to
the fusion threshold (Horovod's dynamic fusion, so communication starts with the first
gradients and keeps pace with backward). Where the gradients live and which travel together
is `gradient_layout`'s; `op=Adasum` is `adasum_optimizer`'s.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from raytrain_x.common.errors import ConfigError
from raytrain_x.common.training import training_settings
from raytrain_x.core import runtime
from raytrain_x.core.collectives import Adasum, Average, Sum, predivided, synchronize
from raytrain_x.core.process_sets import ProcessSet, global_process_set
from raytrain_x.engine.adasum import check_size
from raytrain_x.engine.messages import Handle
from raytrain_x.torch.adasum_optimizer import AdasumOptimizer
from raytrain_x.torch.async_ops import CompositeHandle, allreduce_async_, sparse_allreduce_async
from raytrain_x.torch.compression import Compression, Compressor
from raytrain_x.torch.gradient_layout import (
    GradientBuffer,
    GradientLayout,
    GradientRun,
    explicit_groups,
)
from raytrain_x.torch.hooked_optimizer import (
    HookedOptimizer,
    grad_ready_hooks,
    gradient_hook,
)
from raytrain_x.torch.zero_optimizer import ShardedOptimizer


class GradientAllreduceOptimizer(HookedOptimizer):
    """Mixed in ahead of the wrapped optimizer's class; see `DistributedOptimizer`."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, process_set, bucket_cap_mb=None, groups=None,
                 sparse_as_dense=False):
        super().__init__(params)
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._op = op
        self._process_set = process_set
        self._predivide = gradient_predivide_factor
        self.backward_passes_per_step = backward_passes_per_step
        self._take_parameters(named_parameters, "allreduce")
        self._parameter_names = self._names  # Horovod's attribute name
        # A rank outside the process set trains locally: no collectives (as in Horovod).
        self._member = process_set.ranks is None or runtime.rank() in process_set.ranks
        self._handles: dict[torch.Tensor, Handle] = {}
        self._synchronized = False
        self._should_synchronize = True
        self._hooks = grad_ready_hooks(self, self._requires_update)
        self._arriving = [p.register_hook(gradient_hook(self, p, "_on_grad_arriving"))
                          for p in self._requires_update]
        # A gradient's first arrival tells whether it is sparse (nn.Embedding(sparse=True)):
        # such a parameter leaves its bucket before its sparse gradient would be summed
        # into the bucket's dense view; each probe removes itself after that first look.
        self._probes = {p: p.register_hook(gradient_hook(self, p, "_look"))
                        for p in self._requires_update}
        # arenas by default, fixed buckets when the user sizes them (bucket_cap_mb > 0) or
        # lists them (groups)
        cap = int(bucket_cap_mb * 2**20) if bucket_cap_mb else 0
        self._layout = GradientLayout(self._requires_update, self._names,
                                      explicit_groups(groups, self._requires_update))
        # the request of each unit (bucket or run) sent and not yet waited for
        self._unit_handles: dict[GradientBuffer | GradientRun, Handle] = {}
        self._layout.build(cap)
        if self._layout.fixed:
            runtime.note_fixed_buckets()

    def _scales(self) -> tuple[str, float, float]:
        return predivided(self._op, self._predivide, self._process_set.size())

    @property
    def bucket_cap_bytes(self) -> int:
        """The fixed bucket size in effect (0: no buckets; every gradient goes on its own
        and the engine fuses them up to the fusion threshold)."""
        return self._layout.cap_bytes

    def _look(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """A parameter's first gradient: out of the flat buffers if it is sparse (its unit
        goes now if it was waiting for this gradient alone)."""
        self._probes.pop(p).remove()
        if grad.is_sparse:
            unit = self._layout.make_sparse(p)
            if unit is not None and unit.params and unit not in self._unit_handles:
                self._send_if_complete(unit)

    def _on_grad_arriving(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Before backward adds `p`'s gradient: an arena gradient set to None by
        `zero_grad()` gets its view back, zeroed (so it accumulates there, in place)."""
        if p.grad is None:
            unit = self._layout.unit_of.get(p)
            if isinstance(unit, GradientRun):
                unit.arena.attach_zeroed(p)

    def _allreduce_grad(self, p: torch.Tensor) -> Handle:
        """A gradient outside every unit: a sparse one."""
        if p.grad is None:  # no gradient this step: zeros, as Horovod sends
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse:
            return self._allreduce_sparse(p)
        op, pre, post = self._scales()
        return allreduce_async_(p.grad, name=f"grad.{self._names[p]}", op=op,
                                prescale_factor=pre, postscale_factor=post,
                                process_set=self._process_set, compression=self._compression)

    def _allreduce_sparse(self, p: torch.Tensor) -> Handle:
        """A sparse gradient: densified and reduced like any other (sparse_as_dense), then
        made sparse again for the optimizer; or, as Horovod, an allgather of its indices
        and values whose duplicates sum up."""
        name = f"grad.{self._names[p]}"
        if self._sparse_as_dense:
            dense = p.grad.to_dense()
            op, pre, post = self._scales()
            inner = allreduce_async_(dense, name=name, op=op, prescale_factor=pre,
                                     postscale_factor=post, process_set=self._process_set,
                                     compression=self._compression)
            handle = CompositeHandle(name, [inner], lambda out: out[0].to_sparse())
        else:
            handle = sparse_allreduce_async(p.grad, name, self._op, self._process_set)
        return _Replacing(handle, p)

    def _reset_passes(self) -> None:
        super()._reset_passes()
        for unit in self._layout.units:
            unit.ready = 0

    def _drop_finished(self) -> None:
        """Forgets handles that already ended (a failed world's, after an elastic reset)."""
        for p in [p for p, h in self._handles.items() if h.done()]:
            del self._handles[p]
        for u in [u for u, h in self._unit_handles.items() if h.done()]:
            del self._unit_handles[u]

    def _allreduce_unit(self, unit: GradientBuffer | GradientRun) -> Handle:
        """A bucket (reduced alone) or a run of the arena (the engine may fuse it with the
        runs ready beside it), its gradients pointed at their views first."""
        op, pre, post = self._scales()
        unit.attach()
        return allreduce_async_(unit.flat, name=unit.name, op=op, prescale_factor=pre,
                                postscale_factor=post, process_set=self._process_set,
                                compression=self._compression, fuse=unit.fuse)

    def _send_if_complete(self, unit: GradientBuffer | GradientRun) -> None:
        """Sends `unit` once each of its gradients is ready for every backward pass."""
        if unit.ready >= len(unit.params) * self.backward_passes_per_step:
            unit.ready = 0
            self._unit_handles[unit] = self._allreduce_unit(unit)

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._member:
            return
        unit = self._layout.unit_of.get(p)
        if unit is not None:
            if unit in self._unit_handles:
                if not self._unit_handles[unit].done():
                    raise ConfigError(
                        f"gradient of {self._names[p]!r} computed again before step(); with "
                        "gradient accumulation pass backward_passes_per_step, or call "
                        "synchronize() first")
                del self._unit_handles[unit]  # a failed world's handle
            unit.ready += 1
            self._send_if_complete(unit)
            return
        if p in self._handles and self._handles[p].done():
            self._drop_finished()
        if p in self._handles:
            raise ConfigError(
                f"gradient of {self._names[p]!r} computed twice before step(); with gradient "
                "accumulation pass backward_passes_per_step, or call synchronize() first")
        self._passes[p] += 1
        if self._passes[p] >= self.backward_passes_per_step:
            self._passes[p] = 0
            self._handles[p] = self._allreduce_grad(p)

    def synchronize(self) -> None:
        """Waits for every gradient allreduce (starting those whose hook did not fire)."""
        if not self._member:
            self._synchronized = True
            return
        try:
            for p in self._requires_update:  # those outside every unit: sparse
                if p not in self._handles and p not in self._layout.unit_of:
                    self._handles[p] = self._allreduce_grad(p)
            for unit in self._layout.units:  # units some of whose gradients never came
                if unit not in self._unit_handles:
                    self._unit_handles[unit] = self._allreduce_unit(unit)
            handles = [*self._handles.values(), *self._unit_handles.values()]
            for handle in handles:
                synchronize(handle)
            self._synchronized = True
        finally:  # on failure too: an elastic reset must find no stale handles
            self._handles.clear()
            self._unit_handles.clear()
            self._reset_passes()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Use when `synchronize()` was called by hand (e.g. before gradient clipping)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        already_synchronized = self._synchronized and not self._handles  # done by hand
        if self._should_synchronize and already_synchronized and self._member:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                          "context after optimizer.synchronize(); the gradients were "
                          "reduced already and are used as they are. Wrap step() in "
                          "`with optimizer.skip_synchronize():` to say so.", stacklevel=2)
        if self._should_synchronize and not already_synchronized:
            self.synchronize()
        self._synchronized = False
        result = super().step(closure)
        runtime.mark_step()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes gradients, or sets them to None (the default, as torch's). Gradients in
        fixed buckets stay views of their buffers (zeroed, never None), as with DDP's
        gradient_as_bucket_view; the others find their place in the arena again when
        backward brings the next one, zeroed there just before it is added."""
        self._drop_finished()
        if self._handles or self._unit_handles:
            raise ConfigError("zero_grad() called while gradient allreduces are in flight; "
                              "call step() or synchronize() first")
        self._layout.zero(set_to_none)
        if self._layout.holds_all():
            return None
        return super().zero_grad(set_to_none)


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: str = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: int | Sequence[Sequence[torch.Tensor]] | None = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
    bucket_cap_mb: float | None = None,
    zero_stage: int | None = None,
) -> Any:
    """Wraps `optimizer` so gradients are allreduced while backward runs.

    The result is an instance of a subclass of the optimizer's class (isinstance checks and
    LR schedulers keep working). Each parameter's gradient is submitted from a
    post-accumulate-grad hook as soon as it is ready; `step()` waits for all of them.

    Args:
        optimizer: the local optimizer.
        named_parameters: `model.named_parameters()`, used to name the collectives.
        compression: `Compression.fp16` halves the bytes on the wire.
        backward_passes_per_step: backward passes accumulated locally per allreduce.
        op: `Average` (default), `Sum`, or `Adasum` (Horovod's delta optimizer: each rank
            steps locally and the steps' deltas are combined by Adasum).
        gradient_predivide_factor: divide by this before the sum and by size/factor after.
        num_groups: deprecated Horovod spelling of `groups=<int>`.
        groups: an int k splits the gradients into k fixed buckets of about equal count;
            lists of parameters make one bucket each (parameters in no list are reduced on
            their own). Either way the buckets stay fixed (out of autotune's search).
        sparse_as_dense: reduce sparse gradients (`nn.Embedding(sparse=True)`) as dense
            tensors (given back sparse); by default they go as Horovod sends them, an
            allgather of indices and values.
        process_set: ranks the gradients are reduced over.
        bucket_cap_mb: by default (None, or 0) the gradients are views of one flat buffer
            per dtype and device, cut as DDP cuts its buckets into runs of neighbouring
            gradients (the first closes at 1 MB, the others at a quarter of the buffer, at
            most 4 MB); each run goes to the engine the moment its last gradient is ready,
            and the engine fuses the runs ready in a cycle up to the fusion threshold knob
            (`--fusion-threshold-mb`, which autotune moves), reduced where they lie. A size
            in MB makes DDP-style fixed buckets instead, each with a buffer of its own and
            reduced as one collective, fused with nothing, when its last gradient is ready;
            the fusion threshold then leaves autotune's search.
        zero_stage: 0 keeps every optimizer state and gradient on every rank (the
            default, unless a config file's `zero_stage` reached this worker through
            `raytrain-x run --config-file` or `RaytrainXConfig(config_file=...)`).
            1 shards the optimizer state (ZeRO stage 1): each rank owns whole parameters,
            gradients are reduce-scattered bucket by bucket as backward produces them, each
            rank steps its own parameters and the updated ones are allgathered; 2 also
            keeps only this rank's reduced gradients. `bucket_cap_mb` sizes the buckets
            (25 MB by default); `state_dict()` gives the full state and every rank calls it;
            `clip_grad_norm_` clips by the total norm. Not with `op=Adasum`, `compression`
            or `groups`, nor sparse gradients.
    """
    if backward_passes_per_step < 1:
        raise ConfigError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    if op not in (Average, Sum, Adasum):
        raise ConfigError(f"DistributedOptimizer op must be rx.Average, rx.Sum or rx.Adasum, "
                          f"got {op!r}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ConfigError("gradient_predivide_factor needs op=rx.Average")
    if num_groups and groups is not None:
        raise ConfigError("give groups= (num_groups is its deprecated spelling), not both")
    groups = groups if groups is not None else (num_groups or None)
    if zero_stage is None:  # a config file's, through raytrain-x run or the trainer
        zero_stage = training_settings().get("zero_stage", 0)
    if zero_stage not in (0, 1, 2):
        raise ConfigError(f"zero_stage must be 0, 1 or 2, got {zero_stage!r}")
    if zero_stage:
        if op == Adasum:
            raise ConfigError("zero_stage needs op=rx.Average or rx.Sum, not rx.Adasum")
        if compression is not Compression.none:
            raise ConfigError("zero_stage does not compress gradients; leave compression out")
        if groups:
            raise ConfigError("zero_stage lays the gradients out itself; leave groups out "
                              "(bucket_cap_mb sizes its buckets)")
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ConfigError(f"bucket_cap_mb must be > 0 with zero_stage, got "
                              f"{bucket_cap_mb}")
        cls = type(optimizer.__class__.__name__, (ShardedOptimizer, optimizer.__class__), {})
        wrapped = cls(optimizer.param_groups, named_parameters, zero_stage, op,
                      gradient_predivide_factor, process_set, backward_passes_per_step,
                      bucket_cap_mb)
        wrapped.load_state_dict(optimizer.state_dict())
        return wrapped
    if op == Adasum:
        check_size(process_set.size())
        cls = type(optimizer.__class__.__name__, (AdasumOptimizer, optimizer.__class__), {})
        wrapped = cls(optimizer.param_groups, named_parameters, compression,
                      backward_passes_per_step, process_set)
        wrapped.load_state_dict(optimizer.state_dict())
        return wrapped
    cls = type(optimizer.__class__.__name__,
               (GradientAllreduceOptimizer, optimizer.__class__), {})
    if bucket_cap_mb is not None and not bucket_cap_mb >= 0:
        raise ConfigError(f"bucket_cap_mb must be >= 0 (or None to follow the fusion "
                          f"threshold knob), got {bucket_cap_mb}")
    wrapped = cls(optimizer.param_groups, named_parameters, compression,
                  backward_passes_per_step, op, gradient_predivide_factor, process_set,
                  bucket_cap_mb, groups, sparse_as_dense)
    wrapped.load_state_dict(optimizer.state_dict())
    return wrapped


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
