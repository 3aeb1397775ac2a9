"""`DistributedOptimizer`: allreduce gradients from backward hooks, wait in `step()`.

By default every gradient is a view into one flat buffer per dtype and device (an arena),
laid out in the order backward produces the gradients, and goes to the engine on its own
the moment it is ready. The engine fuses whatever is ready in a cycle up to the fusion
threshold (Horovod's dynamic fusion, so communication starts with the first gradient and
keeps pace with backward) and, a batch lying back to back in the arena, reduces it where it
lies: no fusion-buffer copies. The first step shows the order backward really produces the
gradients; the arena is laid out again in that order once. `bucket_cap_mb` or `groups` fix
buckets instead (DDP's way): each bucket is one collective when its last gradient is ready.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from raytrain_x.autotune.sampler import BATCHING_FIXED_BUCKETS
from raytrain_x.common.errors import ConfigError
from raytrain_x.core import runtime
from raytrain_x.core.collectives import Adasum, Average, Sum, predivided, synchronize
from raytrain_x.core.process_sets import ProcessSet, global_process_set
from raytrain_x.engine.adasum import check_size
from raytrain_x.engine.messages import Handle
from raytrain_x.torch.async_ops import allreduce_async_, sparse_allreduce_async
from raytrain_x.torch.compression import Compression, Compressor
from raytrain_x.torch.requests import CompositeHandle


def _hooks(optimizer, params: list[torch.Tensor]) -> list:
    """Post-accumulate-grad hooks that call `optimizer._on_grad_ready(p)` through a weak
    reference: parameters outlive a dropped optimizer, and a strong reference from their
    hooks would keep it (its flat buffers, its optimizer state) until the cycle collector
    runs, which counts objects, not bytes."""
    me = weakref.ref(optimizer)

    def ready(p: torch.Tensor) -> None:
        opt = me()
        if opt is not None:
            opt._on_grad_ready(p)
    return [p.register_post_accumulate_grad_hook(ready) for p in params]


def _probe(me: weakref.ref, p: torch.Tensor):
    def look(grad: torch.Tensor) -> None:
        opt = me()
        if opt is not None:
            opt._look(p, grad)
    return look


_UNNAMED = itertools.count()  # DistributedOptimizers built without named_parameters


class _Bucket:
    """Parameters whose gradients are views into one persistent flat buffer (a bucket,
    reduced as one collective, or an arena, whose gradients go one by one)."""

    def __init__(self, index: int, params: list[torch.Tensor]) -> None:
        self.name = f"grad.bucket{index}"
        self.params = params
        first = params[0]
        numel = sum(p.numel() for p in params)
        # every view is overwritten by attach() when each parameter has a gradient already
        # (a rebuild); only a first build needs zeros
        fill = torch.empty if all(p.grad is not None for p in params) else torch.zeros
        self.flat = fill(numel, dtype=first.dtype, device=first.device)
        self.views: dict[torch.Tensor, torch.Tensor] = {}
        offset = 0
        for p in params:
            self.views[p] = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.attach()  # copies each existing gradient into its view
        self.ready = 0

    def release(self) -> None:
        """Drops the buffer (its parameters' gradients have moved elsewhere)."""
        self.views = {}
        self.flat = self.flat.new_empty(0)

    def attach(self) -> None:
        """Points every parameter's `.grad` at its view (autograd then accumulates in place)."""
        for p in self.views:
            self.attach_one(p)

    def attach_one(self, p: torch.Tensor) -> None:
        """Points `p.grad` back at its view (after a `model.zero_grad()` set it to None
        and backward made a new tensor), keeping the gradient's value."""
        view = self.views[p]
        if p.grad is not view:
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view


def bucket_groups(params: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Parameters grouped into buckets in reverse registration order (roughly the order
    backward produces grads), one dtype and device each, up to `cap_bytes`."""
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
    return groups


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into the wrapped optimizer's class; see `DistributedOptimizer`."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, process_set, bucket_cap_mb=None, groups=None,
                 sparse_as_dense=False):
        super(self.__class__, self).__init__(params)  # type: ignore[misc]
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._sparse: set[torch.Tensor] = set()  # parameters whose gradients come sparse
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
            # Horovod's names; a second unnamed optimizer (built in the same order on
            # every rank) gets its own, so both can reduce in the same backward
            unnamed = next(_UNNAMED)
            prefix = "allreduce" if unnamed == 0 else f"allreduce.opt{unnamed}"
            by_id = {id(p): f"{prefix}.noname.{i}" for i, p in enumerate(all_params)}
        self._names = {p: by_id[id(p)] for p in all_params}
        self._parameter_names = self._names  # Horovod's attribute name
        # A rank outside the process set trains locally: no collectives (as in Horovod).
        self._member = process_set.ranks is None or runtime.rank() in process_set.ranks
        self._requires_update = [p for p in all_params if p.requires_grad]
        self._handles: dict[torch.Tensor, Handle] = {}
        self._passes: dict[torch.Tensor, int] = {p: 0 for p in self._requires_update}
        self._synchronized = False
        self._should_synchronize = True
        self._hooks = _hooks(self, self._requires_update)
        # A gradient's first arrival tells whether it is sparse (nn.Embedding(sparse=True)):
        # such a parameter leaves its bucket before its sparse gradient would be summed
        # into the bucket's dense view; each probe removes itself after that first look.
        me = weakref.ref(self)
        self._probes = {p: p.register_hook(_probe(me, p)) for p in self._requires_update}
        # Gradient layout (see the module's docstring): arenas by default, fixed buckets
        # when the user sizes them (bucket_cap_mb > 0) or lists them (groups).
        cap = int(bucket_cap_mb * 2**20) if bucket_cap_mb else 0
        self._groups = _explicit_groups(groups, self._requires_update)
        if self._groups is not None or cap > 0:
            runtime.note_batching(BATCHING_FIXED_BUCKETS)
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[torch.Tensor, _Bucket] = {}
        self._bucket_handles: dict[_Bucket, Handle] = {}
        self._arenas: list[_Bucket] = []
        self._arena_of: dict[torch.Tensor, _Bucket] = {}
        self._order: list[torch.Tensor] = []  # gradients in the order their hooks ran
        self._relaid = False  # the arenas follow the order backward produced them in
        self._cap = -1
        self._steps = 0
        self._build_buckets(cap)

    def _scales(self) -> tuple[str, float, float]:
        return predivided(self._op, self._predivide, self._process_set.size())

    @property
    def bucket_cap_bytes(self) -> int:
        """The fixed bucket size in effect (0: no buckets; every gradient goes on its own
        and the engine fuses them up to the fusion threshold)."""
        return self._cap

    def _build_buckets(self, cap_bytes: int, order: list[torch.Tensor] | None = None) -> None:
        """Lays the gradients out in buckets of `cap_bytes` (0: in arenas, in `order` or
        in reverse registration order), keeping their values. Old buffers are freed as soon
        as their last gradient has moved, so a rebuild holds at most about one old and one
        new buffer beyond the gradients themselves."""
        old_of = {**self._bucket_of, **self._arena_of}
        left = {b: len(b.params) for b in (*self._buckets, *self._arenas)}
        dense = [p for p in self._requires_update if p not in self._sparse]
        arenas: list[list[torch.Tensor]] = []
        if self._groups is not None:
            groups = [g for group in self._groups
                      for g in bucket_groups([p for p in group if p not in self._sparse],
                                             2**62)]
        elif cap_bytes > 0:
            groups = bucket_groups(dense, cap_bytes)
        else:
            groups = []
            if order is not None:  # the observed order first, anything it missed after
                seen = set(order)
                kept = set(dense)
                dense = [*(p for p in reversed(dense) if p not in seen),
                         *reversed([p for p in order if p in kept])]
            arenas = bucket_groups(dense, 2**62)  # one per dtype and device run
        self._buckets, self._bucket_of = [], {}
        self._arenas, self._arena_of = [], {}
        for layout, of, params_lists in ((self._buckets, self._bucket_of, groups),
                                         (self._arenas, self._arena_of, arenas)):
            for params in params_lists:
                buffer = _Bucket(len(layout), params)  # copies each gradient into its view
                layout.append(buffer)
                for p in params:
                    of[p] = buffer
                    _moved(p, old_of, left)
        for p in self._requires_update:  # out of every buffer (sparse): owns its gradient
            if p not in self._bucket_of and p not in self._arena_of and p in old_of:
                if p.grad is not None:
                    p.grad = p.grad.clone()
                _moved(p, old_of, left)
        self._cap = cap_bytes

    def _relay_arenas(self) -> None:
        """After the first step whose gradients all came from backward (or the third step,
        if some parameter never gets one): lays the arenas out in the order the hooks ran,
        so the batches the engine fuses lie back to back."""
        order, self._order = self._order, []
        if (self._relaid or not self._arenas or not order
                or (len(order) < len(self._arena_of) and self._steps < 3)):
            return
        self._relaid = True
        laid = [id(p) for arena in self._arenas for p in arena.params]
        if [id(p) for p in order if p in self._arena_of] != laid:
            self._build_buckets(0, order)

    def _look(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """A parameter's first gradient: out of the flat buffers if it is sparse."""
        self._probes.pop(p).remove()
        if grad.is_sparse:
            self._sparse.add(p)
            # out of its buffer, where its slot stays as a hole of zeros: the other
            # gradients keep their views (some may be in flight already)
            holder = self._bucket_of.pop(p, None) or self._arena_of.pop(p, None)
            if holder is not None:
                holder.params.remove(p)
                del holder.views[p]
                p.grad = None

    def _allreduce_grad(self, p: torch.Tensor) -> Handle:
        if p.grad is None:  # no gradient this step: zeros, as Horovod sends
            arena = self._arena_of.get(p)
            if arena is not None:
                arena.views[p].zero_()
                arena.attach_one(p)
            else:
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

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Changes how many backward passes are accumulated per allreduce (Horovod's
        method); counts start again."""
        if passes < 1:
            raise ConfigError(f"backward_passes_per_step must be >= 1, got {passes}")
        self.backward_passes_per_step = passes
        for p in self._passes:
            self._passes[p] = 0
        for bucket in self._buckets:
            bucket.ready = 0

    def _drop_finished(self) -> None:
        """Forgets handles that already ended (a failed world's, after an elastic reset)."""
        for p in [p for p, h in self._handles.items() if h.done()]:
            del self._handles[p]
        for b in [b for b, h in self._bucket_handles.items() if h.done()]:
            del self._bucket_handles[b]

    def _allreduce_bucket(self, bucket: _Bucket) -> Handle:
        op, pre, post = self._scales()
        bucket.attach()
        return allreduce_async_(bucket.flat, name=bucket.name, op=op, prescale_factor=pre,
                                postscale_factor=post, process_set=self._process_set,
                                compression=self._compression, fuse=False)

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._member:
            return
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
        arena = self._arena_of.get(p)
        if arena is not None:
            arena.attach_one(p)
            if not self._relaid and self._passes[p] == 0:
                self._order.append(p)
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
            for p in self._requires_update:
                if p not in self._handles and p not in self._bucket_of:
                    self._handles[p] = self._allreduce_grad(p)
            for bucket in self._buckets:  # buckets some of whose grads never came
                if bucket not in self._bucket_handles:
                    self._bucket_handles[bucket] = self._allreduce_bucket(bucket)
            handles = [*self._handles.values(), *self._bucket_handles.values()]
            for handle in handles:
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
        if self._should_synchronize and already_synchronized and self._member:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                          "context after optimizer.synchronize(); the gradients were "
                          "reduced already and are used as they are. Wrap step() in "
                          "`with optimizer.skip_synchronize():` to say so.", stacklevel=2)
        if self._should_synchronize and not already_synchronized:
            self.synchronize()
        self._synchronized = False
        result = super(self.__class__, self).step(closure)  # type: ignore[misc]
        self._steps += 1
        self._relay_arenas()
        runtime.mark_step()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes gradients. Bucketed gradients stay views of their buffers (zeroed, never
        set to None), as with DDP's gradient_as_bucket_view."""
        self._drop_finished()
        if self._handles or self._bucket_handles:
            raise ConfigError("zero_grad() called while gradient allreduces are in flight; "
                              "call step() or synchronize() first")
        for bucket in (*self._buckets, *self._arenas):
            bucket.flat.zero_()
            bucket.attach()
        if len(self._bucket_of) + len(self._arena_of) == len(self._requires_update):
            return None
        return super(self.__class__, self).zero_grad(set_to_none)  # type: ignore[misc]


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
        bucket_cap_mb: by default (None, or 0) every gradient goes to the engine the
            moment it is ready and the engine fuses what is ready in each cycle up to the
            fusion threshold knob (`--fusion-threshold-mb`, which autotune moves), as
            Horovod does; gradients are views of one flat buffer in the order backward
            makes them, so fused batches are reduced where they lie. A size in MB makes
            DDP-style fixed buckets instead, each reduced as one collective when its last
            gradient is ready; the fusion threshold then leaves autotune's search.
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
    if op == Adasum:
        check_size(process_set.size())
        cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
                   dict(_DistributedAdasumOptimizer.__dict__))
        wrapped = cls(optimizer.param_groups, named_parameters, compression,
                      backward_passes_per_step, process_set)
        wrapped.load_state_dict(optimizer.state_dict())
        return wrapped
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
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


def _explicit_groups(groups: Any, params: list[torch.Tensor]) -> list[list[torch.Tensor]] | None:
    """Horovod's `groups=`: an int k (k buckets of about equal parameter count, in reverse
    registration order) or lists of parameters (one bucket each; the others alone)."""
    if groups is None or groups == 0:
        return None
    ordered = list(reversed(params))
    if isinstance(groups, int):
        if groups < 0:
            raise ConfigError(f"groups must be >= 0, got {groups}")
        k = min(groups, len(ordered)) or 1
        per = -(-len(ordered) // k)
        return [ordered[i:i + per] for i in range(0, len(ordered), per)]
    chosen: list[list[torch.Tensor]] = []
    seen: set[int] = set()
    wanted = {id(p) for p in params}
    for group in groups:
        group = list(group)
        if not all(isinstance(p, torch.Tensor) and id(p) in wanted for p in group):
            raise ConfigError("groups= lists must hold the optimizer's parameters "
                              "(that require gradients)")
        if any(id(p) in seen for p in group):
            raise ConfigError("a parameter appears in two groups= lists")
        seen.update(id(p) for p in group)
        chosen.append(group)
    return chosen + [[p] for p in ordered if id(p) not in seen]


class _DistributedAdasumOptimizer(torch.optim.Optimizer):
    """`DistributedOptimizer(op=Adasum)`: Horovod's delta optimizer. When a parameter's
    gradient is ready, the local optimizer steps that parameter alone; the change it made
    (the delta) is combined across the set by Adasum while backward goes on, and `step()`
    sets every parameter to its value before the local step plus the combined delta."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step,
                 process_set):
        super(self.__class__, self).__init__(params)  # type: ignore[misc]
        self._compression = compression
        self._process_set = process_set
        self.backward_passes_per_step = backward_passes_per_step
        all_params = [p for group in self.param_groups for p in group["params"]]
        names = dict((id(p), n) for n, p in named_parameters) if named_parameters else {}
        self._names = {p: names.get(id(p), f"adasum.noname.{i}")
                       for i, p in enumerate(all_params)}
        self._requires_update = [p for p in all_params if p.requires_grad]
        self._starts = {p: torch.zeros_like(p, requires_grad=False)
                        for p in self._requires_update}
        self._passes = {p: 0 for p in self._requires_update}
        self._handles: dict[torch.Tensor, Handle] = {}
        self._hooks = _hooks(self, self._requires_update)

    def set_backward_passes_per_step(self, passes: int) -> None:
        if passes < 1:
            raise ConfigError(f"backward_passes_per_step must be >= 1, got {passes}")
        self.backward_passes_per_step = passes
        for p in self._passes:
            self._passes[p] = 0

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if p in self._handles:
            raise ConfigError(f"gradient of {self._names[p]!r} computed twice before step(); "
                              "with gradient accumulation pass backward_passes_per_step")
        self._passes[p] += 1
        if self._passes[p] >= self.backward_passes_per_step:
            self._passes[p] = 0
            self._handles[p] = self._step_and_reduce(p)

    @torch.no_grad()
    def _step_and_reduce(self, p: torch.Tensor) -> Handle:
        stashed = [group["params"] for group in self.param_groups]
        for group in self.param_groups:  # the local step, for p only
            group["params"] = [p] if any(p is q for q in group["params"]) else []
        try:
            self._starts[p].copy_(p)
            super(self.__class__, self).step()  # type: ignore[misc]
        finally:
            for group, params in zip(self.param_groups, stashed):
                group["params"] = params
        p.sub_(self._starts[p])  # p now holds this rank's delta
        return allreduce_async_(p.data, name=f"adasum.{self._names[p]}", op=Adasum,
                                process_set=self._process_set, compression=self._compression)

    @torch.no_grad()
    def synchronize(self) -> None:
        try:
            for p in self._requires_update:
                if p not in self._handles:
                    self._handles[p] = self._step_and_reduce(p)
            for p, handle in self._handles.items():
                synchronize(handle)
                self._starts[p].add_(p)  # start + combined delta
                p.copy_(self._starts[p])
        finally:
            self._handles.clear()

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.synchronize()
        runtime.mark_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise ConfigError("zero_grad() called while Adasum reductions are in flight; "
                              "call step() first")
        return super(self.__class__, self).zero_grad(set_to_none)  # type: ignore[misc]


def _moved(p: torch.Tensor, old_of: dict, left: dict) -> None:
    """Counts `p` out of its old bucket; frees that bucket once all its gradients moved."""
    old = old_of.get(p)
    if old is not None:
        left[old] -= 1
        if left[old] == 0:
            old.release()

