"""`DistributedOptimizer` for Keras 3 optimizers: gradients are combined across ranks before
the optimizer uses them.

With `backward_passes_per_step=1` the gradients are reduced in `apply`, before clipping and
the update, as Horovod does. With `backward_passes_per_step=k > 1` the optimizer is built
with Keras's own `gradient_accumulation_steps=k`: each step adds its local gradients to the
accumulators, and only every k-th step reduces their sum (or mean, with
`average_aggregated_gradients`) across ranks and updates the variables, so k-1 of k steps
send nothing. `iterations` counts updates, as Keras 3's accumulation does (Horovod's
counted every pass).

With `reducer=rx.LocalSGD(...)` or `rx.DiLoCo(...)` no gradient is reduced: each rank
updates on its own and every `sync_every` updates the models meet
(`raytrain_x.tensorflow.local_steps`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from raytrain_x.common.errors import ConfigError
from raytrain_x.core.collectives import Adasum, Average
from raytrain_x.core.process_sets import ProcessSet, global_process_set
from raytrain_x.tensorflow.compression import Compression, Compressor
from raytrain_x.tensorflow.gradients import GradientReducer
from raytrain_x.tensorflow.local_steps import LocalSGD, LocalSteps


class _Aggregation:
    """What Horovod's `opt._agg_helper` tells: `counter`, the passes accumulated since the
    last update (a tensor, as Horovod's variable reads)."""

    def __init__(self, optimizer: Any) -> None:
        self._optimizer = optimizer

    @property
    def counter(self) -> Any:
        optimizer = self._optimizer
        return optimizer._iterations.value % optimizer._rx_passes


class _DistributedOptimizer:
    """Mixed in before the wrapped optimizer's class; see `DistributedOptimizer`."""

    _rx_reducer: GradientReducer
    _rx_passes: int = 1
    _rx_average_aggregated: bool = False
    _rx_reduced: bool = False  # compute_gradients combined the gradients apply gets next
    _rx_local: LocalSGD | None = None  # LocalSGD or DiLoCo: no gradient is reduced
    _rx_steps: LocalSteps | None = None  # its state in this optimizer, made by build

    def build(self, variables: Any) -> None:
        super().build(variables)
        if self._rx_local is not None:
            reducer = self._rx_reducer
            self._rx_steps = self._rx_local.bind(self, list(variables), reducer.name,
                                                 reducer.process_set, reducer.is_local)

    @property
    def _agg_helper(self) -> _Aggregation:
        """Horovod's gradient aggregation helper, as its tests read it: `counter`, the
        backward passes since the last update (Keras's accumulation counts them)."""
        if self._rx_passes == 1:
            raise AttributeError("_agg_helper: backward_passes_per_step is 1, nothing is "
                                 "aggregated")
        return _Aggregation(self)

    def register_local_var(self, var: Any) -> None:
        """Keeps the gradient of `var` local: not reduced across ranks (Horovod's name)."""
        self._rx_reducer.register_local_source(var)

    def compute_gradients(self, loss: Any, var_list: Any, tape: Any = None) -> list:
        """Horovod's `compute_gradients`: the gradients of `loss` (a tensor recorded on
        `tape`, or a callable without one) for `var_list`, combined across ranks, as
        `(gradient, variable)` pairs that `apply_gradients` then uses as they are."""
        import tensorflow as tf

        variables = list(var_list() if callable(var_list) else var_list)
        if tape is None:
            if not callable(loss):
                raise ConfigError("compute_gradients: give the GradientTape that recorded "
                                  "`loss`, or `loss` as a callable")
            with tf.GradientTape() as tape:
                loss = loss()
        elif callable(loss):
            with tape:
                loss = loss()
        grads = tape.gradient(loss, variables)
        if self._rx_passes == 1 and self._rx_local is None:
            grads = self._rx_reducer.reduce(list(grads), variables)
            self._rx_reduced = True  # apply_gradients takes them as they are
        return list(zip(grads, variables))

    _compute_gradients = compute_gradients  # the name Horovod's TF 2.4+ optimizers override

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        if self._rx_local is not None:
            if not self.built and trainable_variables is not None:
                self.build(list(trainable_variables))
            if self._rx_steps is None:  # apply raises its own error for this
                return super().apply(grads, trainable_variables)
            self._rx_steps.before_update()
            result = super().apply(grads, trainable_variables)
            self._rx_steps.after_update()
            return result
        if self._rx_reduced:
            self._rx_reduced = False
            return super().apply(grads, trainable_variables)
        if self._rx_passes == 1:
            variables = list(trainable_variables) if trainable_variables is not None else \
                getattr(self, "_trainable_variables", None)
            grads = self._rx_reducer.reduce(list(grads), variables)
        return super().apply(grads, trainable_variables)

    def _clip_gradients(self, grads: Any) -> Any:
        # with accumulation, Keras calls this on the update step only, with the mean of
        # the accumulated gradients: the one place they are combined across ranks
        if self._rx_passes > 1 and self._rx_local is None:
            grads = list(grads)
            if not self._rx_average_aggregated:
                grads = [g if g is None else g * self._rx_passes for g in grads]
            grads = self._rx_reducer.reduce(grads, getattr(self, "_trainable_variables", None))
        return super()._clip_gradients(grads)


def DistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "",
                         device_sparse: str = "",
                         compression: type[Compressor] = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: str = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: int | Sequence[Sequence[Any]] | None = None,
                         process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True,
                         reducer: LocalSGD | None = None) -> Any:
    """A copy of the Keras `optimizer` that combines the gradients over every rank before
    using them (Horovod's `hvd.DistributedOptimizer`, with its arguments in its order).
    `model.fit` uses it unchanged; the copy has the same class name and configuration.

    Args:
        optimizer: a Keras 3 optimizer (`tf.keras.optimizers.*`).
        name: prefix of the gradient collectives' names.
        device_dense: accepted for Horovod's signature (the tensors stay where they are).
        device_sparse: accepted for Horovod's signature, likewise.
        compression: `Compression.fp16` sends floating point gradients as float16.
        sparse_as_dense: densify `tf.IndexedSlices` gradients (embeddings) instead of
            allgathering them.
        gradient_predivide_factor: divide by this before the sum and by size/factor after.
        op: Average (default), Sum, Min, Max or Product.
        backward_passes_per_step: accumulate this many steps' gradients locally and
            communicate once.
        average_aggregated_gradients: divide the accumulated gradients by
            `backward_passes_per_step` (the default sums them, as Horovod).
        num_groups: deprecated spelling of `groups=<int>`.
        groups: an int k sends the gradients in k fixed groups; lists of variables send
            each list's gradients together.
        process_set: ranks that take part.
        scale_local_gradients: divide the gradients of `register_local_var` variables by
            the set's size.
        reducer: `rx.LocalSGD(sync_every=H)` or `rx.DiLoCo(sync_every=H)` for slow links:
            no gradient is reduced; every H updates the variables are averaged (LocalSGD)
            or an outer SGD steps on their averaged difference from the last exchange
            (DiLoCo). `register_local_var` variables stay each rank's own.
    """
    if not (hasattr(optimizer, "apply") and hasattr(optimizer, "get_config")):
        raise ConfigError("DistributedOptimizer wraps a Keras optimizer (keras.optimizers.*), "
                          f"got {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ConfigError("this optimizer is already a DistributedOptimizer")
    if op == Adasum:
        raise ConfigError("op=Adasum is not supported with Keras (as in Horovod); use "
                          "rx.Average")
    passes = int(backward_passes_per_step)
    if passes < 1:
        raise ConfigError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    if reducer is not None:
        _check_local(reducer, op, compression, gradient_predivide_factor, groups, num_groups)
    config = optimizer.get_config()
    if passes > 1:
        if config.get("gradient_accumulation_steps"):
            raise ConfigError("give backward_passes_per_step or the optimizer's own "
                              "gradient_accumulation_steps, not both")
        if isinstance(groups, (list, tuple)):
            raise ConfigError("groups= lists of variables do not combine with "
                              "backward_passes_per_step > 1; use an int for groups")
        config["gradient_accumulation_steps"] = passes
    cls = distributed_class(type(optimizer), name, compression, sparse_as_dense,
                            gradient_predivide_factor, op, passes, average_aggregated_gradients,
                            num_groups, groups, process_set, scale_local_gradients, reducer)
    return cls.from_config(config)


def _check_local(reducer: Any, op: str, compression: Any, predivide: float, groups: Any,
                 num_groups: int) -> None:
    """One clear error for a reducer that is not LocalSGD or DiLoCo, or for arguments
    about reducing gradients every step beside one."""
    if not isinstance(reducer, LocalSGD):
        raise ConfigError(f"reducer must be rx.LocalSGD(...) or rx.DiLoCo(...), got "
                          f"{reducer!r}")
    given = {"op": op != Average, "compression": compression is not Compression.none,
             "gradient_predivide_factor": predivide != 1.0, "groups": bool(groups),
             "num_groups": bool(num_groups)}
    clash = [name for name, set_ in given.items() if set_]
    if clash:
        raise ConfigError(f"{reducer!r} averages whole models every {reducer.sync_every} "
                          f"updates; leave out {', '.join(clash)}")


def PartialDistributedOptimizer(optimizer: Any, name: str | None = None,
                                device_dense: str = "", device_sparse: str = "",
                                compression: type[Compressor] = Compression.none,
                                sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op: str = Average,
                                backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False,
                                num_groups: int = 0,
                                groups: int | Sequence[Sequence[Any]] | None = None,
                                process_set: ProcessSet = global_process_set,
                                local_layers: Any = None,
                                scale_local_gradients: bool = True) -> Any:
    """A `DistributedOptimizer` whose `local_layers` keep their gradients on each rank.

    Args:
        optimizer: a Keras 3 optimizer; it and the arguments up to `process_set` are
            `DistributedOptimizer`'s.
        name: as `DistributedOptimizer`'s.
        device_dense: as `DistributedOptimizer`'s.
        device_sparse: as `DistributedOptimizer`'s.
        compression: as `DistributedOptimizer`'s.
        sparse_as_dense: as `DistributedOptimizer`'s.
        gradient_predivide_factor: as `DistributedOptimizer`'s.
        op: as `DistributedOptimizer`'s.
        backward_passes_per_step: as `DistributedOptimizer`'s.
        average_aggregated_gradients: as `DistributedOptimizer`'s.
        num_groups: as `DistributedOptimizer`'s.
        groups: as `DistributedOptimizer`'s.
        process_set: as `DistributedOptimizer`'s.
        local_layers: a Keras layer or a list of them whose gradients are not combined
            across ranks.
        scale_local_gradients: divide the local layers' gradients by the set's size.
    """
    if local_layers is None:
        layers = []
    elif hasattr(local_layers, "trainable_weights"):
        layers = [local_layers]
    else:
        layers = list(local_layers)
    for layer in layers:
        if not hasattr(layer, "trainable_weights"):
            raise ConfigError("PartialDistributedOptimizer: local_layers takes Keras layers, "
                              f"got {type(layer).__name__}")
    opt = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression,
                               sparse_as_dense, gradient_predivide_factor, op,
                               backward_passes_per_step, average_aggregated_gradients,
                               num_groups, groups, process_set, scale_local_gradients)
    for layer in layers:
        for var in layer.trainable_weights:
            opt.register_local_var(var)
    return opt


def distributed_class(base: type, name: str | None = None,
                      compression: type[Compressor] = Compression.none,
                      sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                      op: str = Average, backward_passes_per_step: int = 1,
                      average_aggregated_gradients: bool = False, num_groups: int = 0,
                      groups: Any = None, process_set: ProcessSet = global_process_set,
                      scale_local_gradients: bool = True, reducer: LocalSGD | None = None
                      ) -> type:
    """The class of `base` optimizers that combine gradients across ranks, with the same
    name as `base` (so a saved model loads without raytrain-x). Its instances share these
    settings; `from_config` builds one (what `load_model` relies on)."""
    settings = {
        "_rx_reducer": GradientReducer(name or "DistributedOptimizer", op,
                                       gradient_predivide_factor, sparse_as_dense, compression,
                                       groups, num_groups, process_set, scale_local_gradients),
        "_rx_passes": int(backward_passes_per_step),
        "_rx_average_aggregated": bool(average_aggregated_gradients),
        "_rx_local": reducer}
    return type(base.__name__, (_DistributedOptimizer, base), settings)
