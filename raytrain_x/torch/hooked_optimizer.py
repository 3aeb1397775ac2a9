"""What both `DistributedOptimizer` kinds share: the gradient hooks that call them through
a weak reference, Horovod's parameter names, and counting backward passes."""

from __future__ import annotations

import collections
import itertools
import weakref
from collections.abc import Callable, Iterable

import torch

from raytrain_x.common.errors import ConfigError

# DistributedOptimizers built without named_parameters, counted per kind of collective
_UNNAMED: dict[str, itertools.count] = collections.defaultdict(itertools.count)


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


def gradient_hook(optimizer: object, p: torch.Tensor,
                  method: str) -> Callable[[torch.Tensor], None]:
    """A gradient hook for `p.register_hook` (it runs before backward accumulates into
    `.grad`) that calls `optimizer.<method>(p, grad)` through a weak reference, as
    `grad_ready_hooks`."""
    me = weakref.ref(optimizer)

    def hook(grad: torch.Tensor) -> None:
        opt = me()
        if opt is not None:
            getattr(opt, method)(p, grad)
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
    unnamed = next(_UNNAMED[kind])
    prefix = kind if unnamed == 0 else f"{kind}.opt{unnamed}"
    return {p: f"{prefix}.noname.{i}" for i, p in enumerate(params)}


class HookedOptimizer:
    """The backward-pass counting both optimizers share (a mixin ahead of the wrapped
    optimizer's class)."""

    backward_passes_per_step: int
    param_groups: list[dict]
    _passes: dict[torch.Tensor, int]

    def _take_parameters(self, named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
                         kind: str, require_all: bool = True) -> None:
        """The groups' parameters: their names (`parameter_names`), those that need
        gradients, and a pass count for each of those."""
        params = [p for group in self.param_groups for p in group["params"]]
        self._names = parameter_names(named_parameters, params, kind, require_all)
        self._requires_update = [p for p in params if p.requires_grad]
        self._passes = {p: 0 for p in self._requires_update}

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Changes how many backward passes are accumulated per allreduce (Horovod's
        method); counts start again."""
        if passes < 1:
            raise ConfigError(f"backward_passes_per_step must be >= 1, got {passes}")
        self.backward_passes_per_step = passes
        self._reset_passes()

    def _reset_passes(self) -> None:
        for p in self._passes:
            self._passes[p] = 0
