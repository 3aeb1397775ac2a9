"""The torch face's one gradient-sync core: what every `DistributedOptimizer` does alike.

`GradientSync` is mixed in ahead of the wrapped optimizer's class. It owns the parameters'
names, the gradient hooks (one after a gradient is accumulated, one before, for the reducers
that lay gradients out), counting backward passes (`backward_passes_per_step`), the refusal
of a gradient computed again before `step()`, and `synchronize`, `skip_synchronize`, `step`
and `zero_grad`. How the gradients are combined is its `Reducer`'s: allreduce (the
default, `allreduce_reducer`), Adasum (`adasum_reducer`), LocalSGD and DiLoCo
(`local_steps`). A reducer is told when a parameter's gradient is complete for the step
and runs the step; it never counts passes nor registers hooks.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from raytrain_x.common.errors import ConfigError
from raytrain_x.common.process import next_number
from raytrain_x.core import runtime
from raytrain_x.core.process_sets import ProcessSet

REDUCER_KEY = "raytrain_x.reducer"  # the reducer's own state in the optimizer's state_dict


def grad_ready_hooks(optimizer: object, params: list[torch.Tensor]) -> list:
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


def _arrival_hook(optimizer: object, p: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """A gradient hook for `p.register_hook` (it runs before backward accumulates into
    `.grad`) that calls `optimizer._on_grad_arriving(p, grad)` through a weak reference."""
    me = weakref.ref(optimizer)

    def hook(grad: torch.Tensor) -> None:
        opt = me()
        if opt is not None:
            opt._on_grad_arriving(p, grad)
    return hook


def parameter_names(named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
                    params: list[torch.Tensor], kind: str,
                    require_all: bool = True) -> dict[torch.Tensor, str]:
    """Each parameter's name in its collectives: from `named_parameters` (names unique;
    with `require_all`, every parameter named) or Horovod's `<kind>.noname.<i>`. A second
    unnamed optimizer (built in the same order on every rank) gets names of its own, so
    both can reduce in the same backward."""
    if named_parameters is not None:
        named = list(named_parameters)
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            dupes = sorted({n for n in names if names.count(n) > 1})
            raise ConfigError(f"named_parameters has duplicate names {dupes}")
        by_id = {id(p): n for n, p in named}
        missing = [i for i, p in enumerate(params) if id(p) not in by_id]
        if missing and require_all:
            raise ConfigError(f"named_parameters misses {len(missing)} of the optimizer's "
                              "parameters; pass model.named_parameters() of the same model")
        return {p: by_id.get(id(p), f"{kind}.noname.{i}") for i, p in enumerate(params)}
    # DistributedOptimizers built without named_parameters, counted per kind of collective
    unnamed = next_number(f"unnamed optimizer.{kind}")
    prefix = kind if unnamed == 0 else f"{kind}.opt{unnamed}"
    return {p: f"{prefix}.noname.{i}" for i, p in enumerate(params)}


class Reducer:
    """How a `DistributedOptimizer`'s gradients are combined: subclass it and pass an
    instance as `reducer=` (docs/reducers.md). The defaults do nothing.

    The optimizer (`core`, a `GradientSync`) calls `ready(p)` once `p`'s gradient is complete
    for the step (every backward pass accumulated), `synchronize()` before the step, and
    `step(closure, synchronize)` for the step itself. A reducer reads the optimizer's
    `reduced_params` (registration order, the same on every rank), `gradient_names` (each
    parameter's name in collectives), `process_set`, and calls `local_step(closure)` for the
    wrapped optimizer's own step; it sends tensors with the collectives of
    `raytrain_x.torch` (`allreduce_async_` and the others: named the same on every rank).

    Attributes:
        kind: the prefix of unnamed parameters' collectives (Horovod's `allreduce.noname.0`).
        require_names: every parameter must be in `named_parameters` when it is given.
        hooks: whether the reducer is told of each gradient (`ready`) during backward.
        every_pass: told of each backward pass's gradient (ZeRO stage 2 reduces each pass
            on its own), rather than once every pass of the step is accumulated.
        arrivals: whether it is told before a gradient is accumulated (`arriving`).
        warns_unskipped: whether `step()` after a `synchronize()` by hand, outside
            `skip_synchronize()`, warns (Horovod's warning: the gradients are not reduced
            twice).
        local_params: the parameters differ between ranks between two of the reducer's
            exchanges, so an elastic sync must not overwrite them (`sync_params`).
    """

    kind = "allreduce"
    require_names = True
    hooks = True
    every_pass = False
    arrivals = False
    warns_unskipped = False
    local_params = False

    def bind(self, core: GradientSync) -> None:
        """Takes the optimizer it serves (its parameters, names, process set, inner step),
        through a weak reference: a dropped optimizer frees its buffers at once, with no
        cycle left for the collector. A subclass lays out what it keeps here."""
        if getattr(self, "_core", None) is not None:  # its buffers and counters are that one's
            raise ConfigError(f"this {type(self).__name__} serves another optimizer already; "
                              "make one per DistributedOptimizer")
        self._core = weakref.ref(core)

    @property
    def core(self) -> GradientSync:
        core = self._core()
        assert core is not None, "the optimizer this reducer served was dropped"
        return core

    def arriving(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """`p`'s gradient is about to be accumulated into `p.grad`."""

    def ready(self, p: torch.Tensor) -> None:
        """`p`'s gradient is complete for this step (every backward pass accumulated; with
        `every_pass`, this pass's)."""

    def busy(self, p: torch.Tensor) -> bool:
        """`p`'s gradient of this step is still being reduced."""
        return False

    def in_flight(self) -> bool:
        """Some reduction was started and not yet waited for."""
        return False

    def synchronize(self) -> None:
        """Starts what backward did not start and waits for every reduction."""

    def forget(self) -> None:
        """Drops every reduction started (after `synchronize`, or a failed world's)."""

    def step(self, closure: Callable[[], Any] | None, synchronize: bool) -> Any:
        """The step: by default the gradients reduced (unless `synchronize()` ran by hand)
        and the wrapped optimizer's step."""
        if synchronize:
            self.core.synchronize()
        return self.core.local_step(closure)

    def zero_grad(self, set_to_none: bool) -> bool:
        """Zeroes what the reducer keeps; True when that was every gradient."""
        return False

    def state_dict(self) -> dict[str, Any] | None:
        """What the reducer keeps across steps (committed with the optimizer's state)."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes `state_dict()`'s value (another rank's at an elastic sync)."""

    def lineage(self) -> int | None:
        """For `local_params` reducers: the exchange the live parameters derive from."""
        return None

    def sync_params(self, lineage: int | None) -> bool:
        """For `local_params` reducers, at an elastic sync after `load_state_dict` took the
        root's state: what this rank's parameters must be (the others' parameters are
        broadcast with their model). True: the root's parameters, broadcast."""
        return True


class GradientSync:
    """Mixed in ahead of the wrapped optimizer's class; see `DistributedOptimizer`."""

    backward_passes_per_step: int
    param_groups: list[dict]

    def __init__(self, params: Any, named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
                 reducer: Reducer, backward_passes_per_step: int,
                 process_set: ProcessSet) -> None:
        super().__init__(params)  # type: ignore[call-arg]
        self.backward_passes_per_step = backward_passes_per_step
        self.process_set = process_set  # Horovod's attribute
        every = [p for group in self.param_groups for p in group["params"]]
        # each parameter's name in its collectives (read by the reducers)
        self.gradient_names = parameter_names(named_parameters, every, reducer.kind,
                                              reducer.require_names)
        self._parameter_names = self.gradient_names  # Horovod's attribute name
        self._requires_update = [p for p in every if p.requires_grad]
        self._passes = {p: 0 for p in self._requires_update}
        self._delivered: set[torch.Tensor] = set()  # complete for this step, handed over
        # A rank outside the process set trains locally: no collectives (as in Horovod).
        self._member = process_set.ranks is None or runtime.rank() in process_set.ranks
        self._synchronized = False  # synchronize() ran by hand since the last step
        self._should_synchronize = True
        self._reducer = reducer
        reducer.bind(self)
        self._hooks = grad_ready_hooks(self, self._requires_update) if reducer.hooks else []
        self._arriving = ([p.register_hook(_arrival_hook(self, p))
                           for p in self._requires_update] if reducer.arrivals else [])

    @property
    def reducer(self) -> Reducer:
        """How this optimizer's gradients are combined (`rx.LocalSGD`, `rx.DiLoCo`, or the
        allreduce or Adasum reducer its `op` chose)."""
        return self._reducer

    @property
    def reduced_params(self) -> list[torch.Tensor]:
        """The parameters whose gradients the reducer combines (those that require
        gradients), in registration order: the same order on every rank."""
        return self._requires_update

    @property
    def bucket_cap_bytes(self) -> int:
        """The fixed bucket size in effect (0: no buckets; the gradients are cut in runs
        the engine fuses up to the fusion threshold; 0 too where no gradient is reduced)."""
        return getattr(self._reducer, "cap_bytes", 0)

    # ------------------------------------------------------------------ backward
    def _on_grad_arriving(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        self._reducer.arriving(p, grad)

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._member:
            return
        if self._reducer.every_pass:
            self._reducer.ready(p)
            return
        passes = self._passes[p] + 1
        if passes < self.backward_passes_per_step:
            self._passes[p] = passes
            return
        self._passes[p] = 0
        if p in self._delivered:
            if self._reducer.busy(p):
                raise ConfigError(
                    f"gradient of {self.gradient_names[p]!r} computed again before step(); with "
                    "gradient accumulation pass backward_passes_per_step, or call "
                    "synchronize() first")
            if self._reducer.in_flight():  # p's own request ended; others are under way
                self._delivered.discard(p)
            else:  # a failed world's requests: all ended, never waited for
                self._forget()
        self._delivered.add(p)
        self._reducer.ready(p)

    def _forget(self) -> None:
        self._reducer.forget()
        self._delivered.clear()
        for p in self._passes:
            self._passes[p] = 0

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Changes how many backward passes are accumulated per reduction (Horovod's
        method); counts start again."""
        if passes < 1:
            raise ConfigError(f"backward_passes_per_step must be >= 1, got {passes}")
        self.backward_passes_per_step = passes
        self._forget()

    # ------------------------------------------------------------------ step
    def synchronize(self) -> None:
        """Waits for every gradient's reduction (starting those whose hook did not fire:
        a parameter without a gradient counts as zeros, as in Horovod)."""
        if not self._member:
            self._synchronized = True
            return
        try:
            self._reducer.synchronize()
            self._synchronized = True
        finally:  # on failure too: an elastic reset must find no stale reduction
            self._forget()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Use when `synchronize()` was called by hand (e.g. before gradient clipping)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def local_step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The wrapped optimizer's own step (a reducer's `step` calls it)."""
        return super().step(closure)  # type: ignore[misc]

    def step(self, closure=None):
        if not self._member:
            result = self.local_step(closure)
            runtime.mark_step()
            return result
        by_hand = self._synchronized
        if self._should_synchronize and by_hand and self._reducer.warns_unskipped:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                          "context after optimizer.synchronize(); the gradients were "
                          "reduced already and are used as they are. Wrap step() in "
                          "`with optimizer.skip_synchronize():` to say so.", stacklevel=2)
        try:
            result = self._reducer.step(closure, self._should_synchronize and not by_hand)
        finally:
            self._synchronized = False
        runtime.mark_step()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes gradients, or sets them to None (the default, as torch's)."""
        if self._reducer.in_flight():
            raise ConfigError("zero_grad() called while gradient reductions are in flight; "
                              "call step() or synchronize() first")
        if self._reducer.zero_grad(set_to_none):
            return None
        return super().zero_grad(set_to_none)  # type: ignore[misc]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()  # type: ignore[misc]
        extra = self._reducer.state_dict()
        if extra is not None:
            state[REDUCER_KEY] = extra
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        extra = state_dict.get(REDUCER_KEY)
        if extra is not None:
            state_dict = {k: v for k, v in state_dict.items() if k != REDUCER_KEY}
        super().load_state_dict(state_dict)  # type: ignore[misc]
        if extra is not None:
            self._reducer.load_state_dict(extra)


def wrap(optimizer: torch.optim.Optimizer, named_parameters: Any, reducer: Reducer,
         backward_passes_per_step: int, process_set: ProcessSet,
         core: type[GradientSync] = GradientSync) -> Any:
    """`optimizer` as an instance of a subclass of its class with `core` (`GradientSync`,
    or a subclass of it) ahead of it (isinstance checks and LR schedulers keep working),
    its state carried over."""
    cls = type(optimizer.__class__.__name__, (core, optimizer.__class__), {})
    wrapped = cls(optimizer.param_groups, named_parameters, reducer,
                  backward_passes_per_step, process_set)
    wrapped.load_state_dict(optimizer.state_dict())
    return wrapped
