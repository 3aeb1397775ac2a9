"""LocalSGD and DiLoCo for the TensorFlow face's Keras optimizers (`DistributedOptimizer(...,
reducer=rx.LocalSGD(...))`): each worker steps on its own, and every `sync_every` updates
the workers' models meet (LocalSGD: their average; DiLoCo: an outer optimizer's step on the
average of their pseudo-gradients, Douillard et al. 2023).

No gradient is reduced. The state is the optimizer's own variables, so that
`optimizer.variables` (and with them a `TensorFlowKerasState`'s commits, its durable
checkpoints and a rank 0 broadcast) carry it: the anchor (the global model of the last
exchange, one variable per trained variable), DiLoCo's outer momentum, and three counters
(updates since the last exchange, exchanges applied, whether the anchor was taken). Every
step is graph ops, so `model.fit` and `tf.function` trace it.

The exchange runs inside the step that makes it (`overlap_steps` is the PyTorch face's
only): a traced step returns when every op in it is done, so an exchange cannot outlive
the step that sends it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from raytrain_x.common.errors import ConfigError
from raytrain_x.core.collectives import Average
from raytrain_x.core.process_sets import ProcessSet


class LocalSGD:
    """LocalSGD: each worker steps on its own; every `sync_every` updates the trained
    variables are averaged across the process set.

    Args:
        sync_every: optimizer updates between two exchanges (>= 1).
        overlap_steps: 0 only (the PyTorch face overlaps the exchange with inner steps; a
            traced TensorFlow step ends when its exchange does).
    """

    kind = "localsgd"

    def __init__(self, sync_every: int, overlap_steps: int = 0) -> None:
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ConfigError(f"sync_every must be an int >= 1 (updates between exchanges), "
                              f"got {sync_every!r}")
        if overlap_steps != 0:
            raise ConfigError("overlap_steps must be 0 in the TensorFlow face: a traced step "
                              "(model.fit, tf.function) ends only when every op in it, the "
                              "exchange too, is done; use the PyTorch face to overlap")
        self.sync_every = sync_every
        self.overlap_steps = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sync_every={self.sync_every})"

    def bind(self, optimizer: Any, variables: list[Any], name: str, process_set: ProcessSet,
             is_local: Callable[[Any], bool]) -> LocalSteps:
        """The state of this reducer in `optimizer` (built over `variables`; those
        `is_local` names stay each rank's own)."""
        return LocalSteps(self, optimizer, variables, name, process_set, is_local)

    def slots(self) -> tuple[str, ...]:
        """Per trained variable, the variables this reducer keeps beside the anchor."""
        return ()

    def payload(self, anchor: list[Any], now: list[tf.Tensor]) -> list[tf.Tensor]:
        """What is averaged: the variables themselves."""
        return now

    def new_global(self, anchor: list[Any], slots: dict[str, list[Any]],
                   averaged: list[tf.Tensor]) -> list[tf.Tensor]:
        """The new global model from the averaged payload: the average itself."""
        return averaged


class DiLoCo(LocalSGD):
    """DiLoCo: each worker steps on its own (the inner optimizer, the one wrapped); every
    `sync_every` updates the pseudo-gradients (the anchor minus each worker's variables)
    are averaged and an outer SGD with Nesterov momentum steps the anchor with them, as in
    DiLoCo's paper (and as `torch.optim.SGD(nesterov=True)` computes it).

    Args:
        sync_every: optimizer updates between two outer steps (>= 1).
        outer_lr: the outer SGD's learning rate.
        outer_momentum: the outer SGD's Nesterov momentum (0: plain SGD; `outer_lr=1.0`
            and 0 momentum is LocalSGD).
        overlap_steps: 0 only, as in `LocalSGD`.
    """

    kind = "diloco"

    def __init__(self, sync_every: int, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 overlap_steps: int = 0) -> None:
        super().__init__(sync_every, overlap_steps)
        if not outer_lr > 0:
            raise ConfigError(f"outer_lr must be > 0, got {outer_lr!r}")
        if not 0 <= outer_momentum < 1:
            raise ConfigError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)

    def __repr__(self) -> str:
        return (f"DiLoCo(sync_every={self.sync_every}, outer_lr={self.outer_lr}, "
                f"outer_momentum={self.outer_momentum})")

    def slots(self) -> tuple[str, ...]:
        return ("rx_outer_momentum",) if self.outer_momentum else ()

    def payload(self, anchor: list[Any], now: list[tf.Tensor]) -> list[tf.Tensor]:
        """The pseudo-gradient: the anchor minus this rank's variables."""
        return [tf.convert_to_tensor(a) - n for a, n in zip(anchor, now)]

    def new_global(self, anchor: list[Any], slots: dict[str, list[Any]],
                   averaged: list[tf.Tensor]) -> list[tf.Tensor]:
        """The anchor after the outer SGD's step on the averaged pseudo-gradient: with
        momentum mu, buf = mu * buf + g and the step is g + mu * buf."""
        mu, out = self.outer_momentum, []
        buffers = slots.get("rx_outer_momentum", [None] * len(averaged))
        for held, grad, buf in zip(anchor, averaged, buffers):
            if buf is not None:
                new_buf = mu * tf.convert_to_tensor(buf) + grad
                buf.assign(new_buf)
                grad = grad + mu * new_buf
            out.append(tf.convert_to_tensor(held) - self.outer_lr * grad)
        return out


class LocalSteps:
    """A LocalSGD or DiLoCo in one optimizer: its variables and the graph ops of a step."""

    def __init__(self, spec: LocalSGD, optimizer: Any, variables: list[Any], name: str,
                 process_set: ProcessSet, is_local: Callable[[Any], bool]) -> None:
        self.spec = spec
        self.optimizer = optimizer
        self.variables = list(variables)
        self.name = f"{name}.{spec.kind}"
        self.process_set = process_set
        self.is_local = is_local  # variables each rank keeps (register_local_var)
        counter = {"shape": (), "dtype": "int64", "initializer": "zeros"}
        self.inner = optimizer.add_variable(name="rx_inner_steps", **counter)
        self.outer = optimizer.add_variable(name="rx_exchanges", **counter)
        self.anchored = optimizer.add_variable(name="rx_anchored", **counter)
        self.anchor = [optimizer.add_variable_from_reference(v, "rx_anchor")
                       for v in self.variables]
        self.slots = {slot: [optimizer.add_variable_from_reference(v, slot)
                             for v in self.variables] for slot in spec.slots()}

    def _exchanged(self) -> list[int]:
        """The indices of the variables exchanged: all but registered local ones."""
        return [i for i, v in enumerate(self.variables) if not self.is_local(v)]

    # ------------------------------------------------------------------ the step
    def before_update(self) -> None:
        """At the first update, the anchor is the model every rank starts from (broadcast
        by then)."""
        def take() -> tf.Tensor:
            for anchor, v in zip(self.anchor, self.variables):
                anchor.assign(v)
            self.anchored.assign(1)
            return tf.constant(True)

        tf.cond(tf.equal(tf.convert_to_tensor(self.anchored), 0), take,
                lambda: tf.constant(False))

    def after_update(self) -> None:
        """Counts the update (with gradient accumulation, only the steps that update) and
        exchanges at every `sync_every`-th."""
        steps = self.optimizer.gradient_accumulation_steps
        iterations = tf.convert_to_tensor(self.optimizer._iterations)
        updated = (tf.cast(tf.equal(iterations % steps, 0), tf.int64) if steps
                   else tf.constant(1, tf.int64))
        self.inner.assign_add(updated)
        tf.cond(tf.greater_equal(tf.convert_to_tensor(self.inner), self.spec.sync_every),
                self._exchange, lambda: tf.constant(False))

    def _exchange(self) -> tf.Tensor:
        from raytrain_x.tensorflow.collectives import grouped_allreduce

        chosen = self._exchanged()
        anchor = [self.anchor[i] for i in chosen]
        slots = {slot: [vs[i] for i in chosen] for slot, vs in self.slots.items()}
        now = [tf.convert_to_tensor(self.variables[i]) for i in chosen]
        payload = self.spec.payload(anchor, now)
        # a rank outside the process set exchanges with itself, as its gradients would be
        # its own (`gradients._reduces`)
        averaged = (grouped_allreduce(payload, op=Average, name=self.name,
                                      process_set=self.process_set)
                    if self.process_set.included() else payload)
        new = self.spec.new_global(anchor, slots, averaged)
        for i, value in zip(chosen, new):
            self.anchor[i].assign(value)
            self.variables[i].assign(value)
        self.inner.assign(0)
        self.outer.assign_add(1)
        return tf.constant(True)

    # ------------------------------------------------------------------ elastic
    def lineage(self) -> int | None:
        """The exchange the live variables derive from (None: never anchored)."""
        if not int(np.asarray(self.anchored.numpy())):
            return None
        return int(np.asarray(self.outer.numpy()))

    def own_values(self) -> list[np.ndarray]:
        """Copies of the variables an elastic sync broadcasts though they are each rank's:
        the registered local ones (the exchanged ones are not broadcast once an anchor
        exists)."""
        exchanged = set(self._exchanged())
        return [np.array(v.numpy(), copy=True) for i, v in enumerate(self.variables)
                if i not in exchanged]

    def exchanged(self) -> list[Any]:
        """The trained variables the exchanges average (all but registered local ones):
        an elastic sync does not broadcast them once an anchor exists (`sync_params`)."""
        return [self.variables[i] for i in self._exchanged()]

    def sync_params(self, lineage: int | None, own: list[np.ndarray]) -> bool:
        """At an elastic sync, after rank 0's variables except `exchanged()` were broadcast
        (the optimizer's with this state among them): a rank whose variables (`lineage`
        and `own_values()`, taken before it) derive from rank 0's last exchange keeps them
        (its exchanged variables were never overwritten; its local ones are put back); any
        other (a newcomer) takes the anchor. True: rank 0 has no anchor yet (no update
        taken; the same answer on every rank), and the caller gives every rank rank 0's
        `exchanged()` variables."""
        if self.lineage() is None:
            return True
        if lineage == self.lineage():
            exchanged = set(self._exchanged())
            local = [v for i, v in enumerate(self.variables) if i not in exchanged]
            for v, value in zip(local, own):
                v.assign(value)
        else:  # local variables stay as broadcast
            for i in self._exchanged():
                self.variables[i].assign(self.anchor[i])
        return False
