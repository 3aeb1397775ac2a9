"""`DistributedOptimizer`: allreduce gradients from backward hooks, wait in `step()`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch

from raytrain_x.common.errors import ConfigError
from raytrain_x.fusion.messages import Handle
from raytrain_x.fusion.runtime import ProcessSet, global_process_set
from raytrain_x.torch.compression import Compression, Compressor
from raytrain_x.torch.ops import Average, Sum, allreduce_async_, synchronize


class _Bucket:
    """Parameters whose gradients are views into one persistent flat buffer."""

    def __init__(self, index: int, params: list[torch.Tensor]) -> None:
        self.name = f"grad.bucket{index}"
        self.params = params
        first = params[0]
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=first.dtype,
                                device=first.device)
        self.views: dict[torch.Tensor, torch.Tensor] = {}
        offset = 0
        for p in params:
            view = self.flat[offset:offset + p.numel()].view_as(p)
            if p.grad is not None:
                view.copy_(p.grad)
            self.views[p] = view
            offset += p.numel()
        self.attach()
        self.ready = 0

    def attach(self) -> None:
        """Points every parameter's `.grad` at its view (autograd then accumulates in place)."""
        for p, view in self.views.items():
            if p.grad is not view:
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view


def _buckets(params: list[torch.Tensor], cap_bytes: int) -> list[_Bucket]:
    """Buckets in reverse registration order (roughly the order backward produces grads),
    one dtype and device each, up to `cap_bytes`."""
    groups: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > cap_bytes or p.dtype != current[0].dtype
                        or p.device != current[0].device):
            groups.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        groups.append(current)
    return [_Bucket(i, g) for i, g in enumerate(groups)]


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into the wrapped optimizer's class; see `DistributedOptimizer`."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, process_set, bucket_cap_mb=25.0):
        super(self.__class__, self).__init__(params)  # type: ignore[misc]
        self._compression = compression
        self._op = op
        self._process_set = process_set
        self._predivide = gradient_predivide_factor
        self.backward_passes_per_step = backward_passes_per_step
        all_params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            names = [n for n, _ in named]
            if len(set(names)) != len(names):
                dupes = sorted({n for n in names if names.count(n) > 1})
                raise ConfigError(f"named_parameters has duplicate names {dupes}")
            by_id = {id(p): n for n, p in named}
            missing = [i for i, p in enumerate(all_params) if id(p) not in by_id]
            if missing:
                raise ConfigError(f"named_parameters misses {len(missing)} of the optimizer's "
                                  "parameters; pass model.named_parameters() of the same model")
        else:
            by_id = {id(p): f"allreduce.noname.{i}" for i, p in enumerate(all_params)}
        self._names = {p: by_id[id(p)] for p in all_params}
        self._requires_update = [p for p in all_params if p.requires_grad]
        self._handles: dict[torch.Tensor, Handle] = {}
        self._passes: dict[torch.Tensor, int] = {p: 0 for p in self._requires_update}
        self._synchronized = False
        self._should_synchronize = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for p in self._requires_update]
        # Gradient buckets: grads are views into persistent flat buffers, each bucket is
        # reduced in place the moment its last gradient is ready (no pack/unpack copies).
        self._buckets = (_buckets(self._requires_update, int(bucket_cap_mb * 2**20))
                         if bucket_cap_mb > 0 else [])
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._bucket_handles: dict[_Bucket, Handle] = {}

    def _scales(self) -> tuple[float, float]:
        if self._op == Average and self._predivide != 1.0:
            # Sum of grads / f, then * f / size: same result, smaller intermediate values.
            size = self._process_set.size()
            return 1.0 / self._predivide, self._predivide / size
        return 1.0, 1.0

    def _allreduce_grad(self, p: torch.Tensor) -> Handle:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        pre, post = self._scales()
        op = Sum if (self._op == Average and self._predivide != 1.0) else self._op
        return allreduce_async_(p.grad, name=f"grad.{self._names[p]}", op=op,
                                prescale_factor=pre, postscale_factor=post,
                                process_set=self._process_set, compression=self._compression)

    def _drop_finished(self) -> None:
        """Forgets handles that already ended (a failed world's, after an elastic reset)."""
        for p in [p for p, h in self._handles.items() if h.done()]:
            del self._handles[p]
        for b in [b for b, h in self._bucket_handles.items() if h.done()]:
            del self._bucket_handles[b]

    def _allreduce_bucket(self, bucket: _Bucket) -> Handle:
        pre, post = self._scales()
        op = Sum if (self._op == Average and self._predivide != 1.0) else self._op
        bucket.attach()
        return allreduce_async_(bucket.flat, name=bucket.name, op=op, prescale_factor=pre,
                                postscale_factor=post, process_set=self._process_set,
                                compression=self._compression, fuse=False)

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        bucket = self._bucket_of.get(p)
        if bucket is not None:
            if bucket in self._bucket_handles:
                if not self._bucket_handles[bucket].done():
                    raise ConfigError(
                        f"gradient of {self._names[p]!r} computed again before step(); with "
                        "gradient accumulation pass backward_passes_per_step")
                del self._bucket_handles[bucket]  # a failed world's handle
            bucket.ready += 1
            if bucket.ready >= len(bucket.params) * self.backward_passes_per_step:
                bucket.ready = 0
                self._bucket_handles[bucket] = self._allreduce_bucket(bucket)
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
        try:
            for p in self._requires_update:
                if p not in self._handles and p not in self._bucket_of:
                    self._handles[p] = self._allreduce_grad(p)
            for bucket in self._buckets:  # buckets some of whose grads never came
                if bucket not in self._bucket_handles:
                    self._bucket_handles[bucket] = self._allreduce_bucket(bucket)
            for handle in [*self._handles.values(), *self._bucket_handles.values()]:
                synchronize(handle)
            self._synchronized = True
        finally:  # on failure too: an elastic reset must find no stale handles
            self._handles.clear()
            self._bucket_handles.clear()
            for bucket in self._buckets:
                bucket.ready = 0
            for p in self._passes:
                self._passes[p] = 0

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
        if self._should_synchronize and not already_synchronized:
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes gradients. Bucketed gradients stay views of their buffers (zeroed, never
        set to None), as with DDP's gradient_as_bucket_view."""
        self._drop_finished()
        if self._handles or self._bucket_handles:
            raise ConfigError("zero_grad() called while gradient allreduces are in flight; "
                              "call step() or synchronize() first")
        for bucket in self._buckets:
            bucket.flat.zero_()
            bucket.attach()
        if len(self._bucket_of) == len(self._requires_update):
            return None
        return super(self.__class__, self).zero_grad(set_to_none)  # type: ignore[misc]


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: str = Average,
    gradient_predivide_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    bucket_cap_mb: float = 25.0,
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
        op: `Average` (default) or `Sum`.
        gradient_predivide_factor: divide by this before the sum and by size/factor after.
        process_set: ranks the gradients are reduced over.
        bucket_cap_mb: gradients are views into flat buckets of at most this size, each
            reduced in place as soon as its last gradient is ready; 0 reduces every
            gradient on its own through the engine's fusion (Horovod's way).
    """
    if backward_passes_per_step < 1:
        raise ConfigError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    if op not in (Average, Sum):
        raise ConfigError(f"DistributedOptimizer op must be rx.Average or rx.Sum, got {op!r}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ConfigError("gradient_predivide_factor needs op=rx.Average")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    if bucket_cap_mb < 0:
        raise ConfigError(f"bucket_cap_mb must be >= 0, got {bucket_cap_mb}")
    wrapped = cls(optimizer.param_groups, named_parameters, compression,
                  backward_passes_per_step, op, gradient_predivide_factor, process_set,
                  bucket_cap_mb)
    wrapped.load_state_dict(optimizer.state_dict())
    return wrapped
