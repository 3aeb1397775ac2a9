"""Reducers for slow links: each worker steps on its own, and every `sync_every` steps the
workers' models meet (LocalSGD: their average; DiLoCo: an outer optimizer's step on the
average of their pseudo-gradients, Douillard et al. 2023).

No gradient is reduced during backward. At an exchange each rank sends one flat buffer per
dtype and device (its parameters, or the anchor minus its parameters) in one averaging
allreduce. With `overlap_steps` the exchange runs beside that many more inner steps: when it
lands, each rank's parameters become the new global model plus the progress it made while
the exchange was on the wire (Streaming DiLoCo's overlap); the exchange is applied after
exactly that many steps on every rank, so ranks stay in step.

The anchor (the global model of the last exchange), the outer optimizer's state and the
step counters are the reducer's state: committed with the optimizer's, given by the root at
an elastic sync. At a sync a rank keeps its own parameters when they derive from the same
exchange as the root's (a survivor keeps its inner steps; a worker lost between exchanges
loses only its own); any other rank (a newcomer) takes the anchor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from raytrain_x.common.errors import ConfigError
from raytrain_x.core.collectives import Average, synchronize
from raytrain_x.engine.messages import Handle
from raytrain_x.torch.async_ops import allreduce_async_
from raytrain_x.torch.grad_sync import GradientSync, Reducer


def _groups(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The parameters by (dtype, device), in registration order: one flat buffer each."""
    by_key: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        by_key.setdefault((p.dtype, p.device), []).append(p)
    return list(by_key.values())


def _views(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """`flat` (the parameters laid end to end, as `_flat_params` makes it) as views shaped
    like each of `params`."""
    return [piece.view_as(p) for piece, p in
            zip(flat.split([p.numel() for p in params]), params)]


class _Exchange:
    """One exchange on the wire: its handles, and (with overlap) each flat buffer's
    parameters at the moment it was sent."""

    def __init__(self, handles: list[Handle], sent: list[torch.Tensor] | None) -> None:
        self.handles = handles
        self.sent = sent
        self.age = 0  # inner steps since it was sent


class LocalSGD(Reducer):
    """LocalSGD: each worker steps on its own; every `sync_every` steps the parameters
    are averaged across the process set.

    Args:
        sync_every: inner steps between two exchanges (>= 1).
        overlap_steps: inner steps the exchange runs beside before it is applied (0: the
            step that sends it waits for it).
    """

    kind = "localsgd"
    hooks = False
    local_params = True

    def __init__(self, sync_every: int, overlap_steps: int = 0) -> None:
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ConfigError(f"sync_every must be an int >= 1 (inner steps between "
                              f"exchanges), got {sync_every!r}")
        if (isinstance(overlap_steps, bool) or not isinstance(overlap_steps, int)
                or not 0 <= overlap_steps < sync_every):
            raise ConfigError(f"overlap_steps must be an int in [0, sync_every), got "
                              f"{overlap_steps!r}")
        self.sync_every = sync_every
        self.overlap_steps = overlap_steps
        self._inner = 0  # inner steps since the last exchange was sent
        self._outer = 0  # exchanges applied
        self._params_outer: int | None = None  # the exchange the live parameters derive from
        self._anchor: list[torch.Tensor] | None = None  # flat, per group
        self._pending: _Exchange | None = None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(sync_every={self.sync_every}, "
                f"overlap_steps={self.overlap_steps})")

    @property
    def exchanges(self) -> int:
        """How many exchanges this rank has applied (its parameters derive from the
        last one's global model)."""
        return self._outer

    def bind(self, core: GradientSync) -> None:
        super().bind(core)
        self._param_groups = _groups(core.reduced_params)

    # ------------------------------------------------------------------ the step
    def step(self, closure: Callable[[], Any] | None, synchronize: bool) -> Any:
        if self._anchor is None:  # the model every rank starts from (broadcast by now)
            self._anchor = self._flat_params()
            self._params_outer = self._outer
        result = self.core.local_step(closure)
        self._inner += 1
        if self._pending is not None:
            self._pending.age += 1
            if self._pending.age >= self.overlap_steps:
                self._apply(self._pending)
        if self._inner >= self.sync_every:
            self._inner = 0
            self._pending = self._send()
            if self.overlap_steps == 0:
                self._apply(self._pending)
        return result

    def synchronize(self) -> None:
        """Applies an exchange still on the wire (with `overlap_steps`, one sent within
        the last `overlap_steps` steps): call `optimizer.synchronize()` on every rank after
        the last step, so each ends on the last exchange's model plus its own steps since,
        and no rank leaves while another has yet to send its part."""
        if self._pending is not None:
            self._apply(self._pending)

    @torch.no_grad()
    def _flat_params(self) -> list[torch.Tensor]:
        return [torch.cat([p.detach().reshape(-1) for p in ps]) for ps in self._param_groups]

    @torch.no_grad()
    def _send(self) -> _Exchange:
        now = self._flat_params()
        payload = self._payload(now)
        core = self.core
        prefix = f"{self.kind}.{core.gradient_names[self._param_groups[0][0]]}"
        handles = [allreduce_async_(flat, name=f"{prefix}.{i}", op=Average,
                                    process_set=core.process_set)
                   for i, flat in enumerate(payload)]
        return _Exchange(handles, now if self.overlap_steps else None)

    def _payload(self, now: list[torch.Tensor]) -> list[torch.Tensor]:
        """What is averaged: the parameters themselves (a copy when `now` is kept for the
        overlap: the allreduce averages in place)."""
        return [n.clone() for n in now] if self.overlap_steps else now

    def _global(self, averaged: list[torch.Tensor]) -> list[torch.Tensor]:
        """The new global model from the averaged payload: the average itself."""
        return averaged

    @torch.no_grad()
    def _apply(self, exchange: _Exchange) -> None:
        self._pending = None
        averaged = [synchronize(h) for h in exchange.handles]
        new = self._global(averaged)
        self._anchor = new
        for flat, sent, ps in zip(new, exchange.sent or [None] * len(new), self._param_groups):
            if sent is None:
                for p, target in zip(ps, _views(flat, ps)):
                    p.copy_(target)
            else:  # the global model plus what this rank did while it was on the wire
                for p, target, then in zip(ps, _views(flat, ps), _views(sent, ps)):
                    p.add_(target - then)
        self._outer += 1
        self._params_outer = self._outer

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"sync_every": self.sync_every, "inner": self._inner, "outer": self._outer,
                "params_outer": self._params_outer,
                "anchor": [a.detach().clone() for a in self._anchor] if self._anchor else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = None  # an exchange of the live world is moot once state is loaded
        self._inner = int(state["inner"])
        self._outer = int(state["outer"])
        self._params_outer = state["params_outer"]
        anchor = state["anchor"]
        self._anchor = None if anchor is None else [
            a.to(ps[0].device, copy=True) for a, ps in zip(anchor, self._param_groups)]

    def lineage(self) -> int | None:
        """The exchange the live parameters derive from (None: never synced)."""
        return self._params_outer

    @torch.no_grad()
    def sync_params(self, lineage: int | None) -> bool:
        """After the root's state was loaded at an elastic sync: a rank whose parameters
        (`lineage`, taken before the load) derive from the root's last exchange keeps
        them; any other takes the anchor. True: there is no anchor yet (no step taken),
        and the caller gives every rank the root's parameters."""
        self._params_outer = self._outer
        if self._anchor is None:  # the root's state: the same answer on every rank
            return True
        if lineage != self._outer:
            for flat, ps in zip(self._anchor, self._param_groups):
                for p, target in zip(ps, _views(flat, ps)):
                    p.copy_(target)
        return False


class DiLoCo(LocalSGD):
    """DiLoCo: each worker steps on its own (the inner optimizer, the one wrapped); every
    `sync_every` steps the pseudo-gradients (the anchor minus each worker's parameters) are
    averaged and an outer optimizer steps the anchor with them, SGD with Nesterov momentum
    by default, as in DiLoCo's paper.

    Args:
        sync_every: inner steps between two outer steps (>= 1).
        outer_lr: the outer SGD's learning rate.
        outer_momentum: the outer SGD's Nesterov momentum (0: plain SGD; `outer_lr=1.0`
            and 0 momentum is LocalSGD).
        overlap_steps: inner steps the exchange runs beside before it is applied.
        outer_optimizer: instead of the outer SGD, a callable taking the list of anchor
            tensors and returning a `torch.optim.Optimizer` over them.
    """

    kind = "diloco"

    def __init__(self, sync_every: int, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 overlap_steps: int = 0,
                 outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
                 | None = None) -> None:
        super().__init__(sync_every, overlap_steps)
        if not outer_lr > 0:
            raise ConfigError(f"outer_lr must be > 0, got {outer_lr!r}")
        if not 0 <= outer_momentum < 1:
            raise ConfigError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self._make_outer = outer_optimizer
        self._outer_opt: torch.optim.Optimizer | None = None
        self._outer_state: dict[str, Any] | None = None  # loaded before the anchor exists

    def __repr__(self) -> str:
        return (f"DiLoCo(sync_every={self.sync_every}, outer_lr={self.outer_lr}, "
                f"outer_momentum={self.outer_momentum}, overlap_steps={self.overlap_steps})")

    def _outer_optimizer(self) -> torch.optim.Optimizer:
        """The outer optimizer over the anchor (the same tensors from now on)."""
        if self._outer_opt is None:
            assert self._anchor is not None
            if self._make_outer is not None:
                self._outer_opt = self._make_outer(self._anchor)
            else:
                self._outer_opt = torch.optim.SGD(
                    self._anchor, lr=self.outer_lr, momentum=self.outer_momentum,
                    nesterov=self.outer_momentum > 0)
            if self._outer_state is not None:
                self._outer_opt.load_state_dict(self._outer_state)
                self._outer_state = None
        return self._outer_opt

    def _payload(self, now: list[torch.Tensor]) -> list[torch.Tensor]:
        """The pseudo-gradient: the anchor minus this rank's parameters."""
        assert self._anchor is not None
        return [a - n for a, n in zip(self._anchor, now)]

    def _global(self, averaged: list[torch.Tensor]) -> list[torch.Tensor]:
        """The anchor after the outer optimizer's step on the averaged pseudo-gradient."""
        outer = self._outer_optimizer()
        assert self._anchor is not None
        for anchor, grad in zip(self._anchor, averaged):
            anchor.grad = grad
        outer.step()
        for anchor in self._anchor:
            anchor.grad = None
        return self._anchor

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._outer_opt is not None:
            state["outer_optimizer"] = self._outer_opt.state_dict()
        elif self._outer_state is not None:
            state["outer_optimizer"] = self._outer_state
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        # a new anchor: the outer optimizer is made again over it, with the state given
        self._outer_opt = None
        self._outer_state = state.get("outer_optimizer")
