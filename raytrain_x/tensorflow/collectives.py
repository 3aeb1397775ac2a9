"""Horovod's TensorFlow collectives, differentiable, with Horovod's signatures.

Each works eagerly, inside `tf.function` and in a `tf.compat.v1` graph run by a session.
The forward values come from the zero-copy kernels of `raytrain_x.tensorflow.ops`; the
gradients follow Horovod's rules (the same as the PyTorch face's, `raytrain_x.torch.ops`):

- allreduce: the allreduce of the gradient, with the same op and factors;
- allgather: this rank's rows of the members' averaged gradient;
- broadcast: the members' averaged gradient on the root, zeros elsewhere;
- alltoall: the gradient goes back to the senders, split as it was received;
- reducescatter: the allgather of the gradient, times the set's size for Sum (and the
  pre- and postscale factors).

Only floating point inputs get a gradient; integer and bool collectives are plain ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from raytrain_x.common.errors import ConfigError
from raytrain_x.core import collectives as _core
from raytrain_x.core import runtime
from raytrain_x.core.collectives import Adasum, Average, Sum
from raytrain_x.core.process_sets import ProcessSet, global_process_set
from raytrain_x.engine import adasum
from raytrain_x.engine.messages import ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, REDUCESCATTER
from raytrain_x.tensorflow import ops
from raytrain_x.tensorflow.arrays import as_tensor, op_name
from raytrain_x.tensorflow.chunked_reduce import grouped_reduce
from raytrain_x.tensorflow.compression import Compression
from raytrain_x.tensorflow.differentiable import differentiable, engine_compressed
from raytrain_x.tensorflow.errors import NotSupportedError, raises_tf_errors


# ------------------------------------------------------------------------- allreduce
@raises_tf_errors
def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "",
              device_sparse: str = "", compression: Any = Compression.none,
              op: str | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: str | None = None,
              process_set: ProcessSet = global_process_set,
              ignore_name_scope: bool = False) -> Any:
    """Allreduce of `tensor` across the process set (default op: Average).

    Args:
        tensor: a tensor, variable or tf.IndexedSlices (reduced by allgather, as in
            Horovod).
        average: deprecated Horovod flag; use `op`.
        device_dense: where TensorFlow places the ops around dense tensors.
        device_sparse: where TensorFlow places the ops around `tf.IndexedSlices`.
        compression: `Compression.fp16` sends floating point tensors as float16; any
            object with Horovod's `compress(t) -> (t, ctx)` / `decompress(t, ctx)` works.
        op: Average, Sum, Adasum (a power-of-two number of ranks), Min, Max or Product.
        prescale_factor: multiplies the tensor before the reduction.
        postscale_factor: multiplies the result after the reduction.
        name: the collective's name, the same on every rank; automatic if None.
        process_set: ranks that take part.
        ignore_name_scope: accepted for Horovod's signature; names never include scopes.
    """
    op = _core.resolve_op(op, average)
    return _grouped_allreduce([tensor], op_name(ALLREDUCE, name, process_set), device_dense,
                              device_sparse, compression, op, prescale_factor,
                              postscale_factor, process_set)[0]


@raises_tf_errors
def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None,
                      device_dense: str = "", device_sparse: str = "",
                      compression: Any = Compression.none, op: str | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      ignore_name_scope: bool = False,
                      name: str | None = None) -> list[Any]:
    """Allreduces of several tensors, negotiated together and fused up to the fusion
    threshold; IndexedSlices among them are allgathered.

    Args:
        tensors: tensors, in the same order, dtypes and shapes on every member.
        average: deprecated Horovod flag: True means `op=Average`, False `op=Sum`; use `op`.
        device_dense: accepted for Horovod's signature (the tensors stay where they are).
        device_sparse: accepted for Horovod's signature, likewise.
        compression: `Compression.fp16` sends floating-point tensors as float16 and casts back.
        op: Average (default), Sum, Adasum, Min, Max or Product.
        prescale_factor: multiplies the input before the reduction (Sum and Average).
        postscale_factor: multiplies the result after the reduction (Sum and Average).
        process_set: the ranks that take part (default: every rank).
        ignore_name_scope: accepted for Horovod's signature (names do not take the name scope).
        name: the collective's name, the same on every member; automatic if None.
    """
    if not tensors:
        return []
    return _grouped_allreduce(tensors, op_name("grouped_allreduce", name, process_set),
                              device_dense, device_sparse, compression,
                              _core.resolve_op(op, average), prescale_factor,
                              postscale_factor, process_set)


def _grouped_allreduce(tensors: Sequence[Any], name: str, device_dense: str,
                       device_sparse: str, compression: Any, op: str, prescale_factor: float,
                       postscale_factor: float, process_set: ProcessSet) -> list[Any]:
    if op == Adasum:
        adasum.check_size(process_set.size())
        if any(isinstance(t, tf.IndexedSlices) for t in tensors):
            raise NotSupportedError("op=Adasum does not take tf.IndexedSlices (as in Horovod); "
                              "densify them (sparse_as_dense=True)")
        if not all(tf.as_dtype(getattr(t, "dtype", tf.float32)).is_floating for t in tensors):
            raise ConfigError("op=Adasum needs floating point tensors")
    out: list[Any] = [None] * len(tensors)
    dense = []
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            if prescale_factor != 1.0 or postscale_factor != 1.0:
                raise NotSupportedError("prescale_factor/postscale_factor do not apply to "
                                        "tf.IndexedSlices; densify with tf.convert_to_tensor "
                                        "first")
            with tf.device(device_sparse):
                out[i] = ops.allreduce_sparse(t, f"{name}.sparse{i}", op, process_set)
        else:
            dense.append((i, as_tensor(t, "allreduce")))
    pre, post = ops.reduce_scales(op, prescale_factor, postscale_factor, [t for _, t in dense])
    with tf.device(device_dense):
        reduced = _reduce([t for _, t in dense], name, op, pre, post, process_set, compression)
    for (i, _), r in zip(dense, reduced):
        out[i] = r
    return out


def _reduce(tensors: list[tf.Tensor], name: str, op: str, pre: float, post: float,
            process_set: ProcessSet, compression: Any) -> list[tf.Tensor]:
    def forward(*xs: tf.Tensor) -> list[tf.Tensor]:
        if engine_compressed(compression):
            return grouped_reduce(list(xs), name, op, pre, post, process_set, compression)
        pairs = [compression.compress(x) for x in xs]
        reduced = grouped_reduce([c for c, _ in pairs], name, op, pre, post, process_set,
                                 Compression.none)
        return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]

    def backward(dys: list[tf.Tensor]) -> list[tf.Tensor]:
        return _reduce(dys, op_name("grouped_allreduce", None, process_set), op, pre, post,
                       process_set, compression)

    return differentiable(forward, backward, tensors)


# ------------------------------------------------------------------------- allgather
@raises_tf_errors
def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Every member's tensor concatenated along dim 0, in rank order; members may differ
    in dim 0, not in the other dims. A scalar is gathered as a 1-element vector.

    Args:
        tensor: the tensor; members may differ in dim 0, not in the other dims.
        name: the collective's name, the same on every member; automatic if None.
        ignore_name_scope: accepted for Horovod's signature (names do not take the name scope).
        process_set: the ranks that take part (default: every rank).
    """
    tensor = as_tensor(tensor, "allgather")
    return _allgather([tensor], op_name(ALLGATHER, name, process_set), process_set)[0]


@raises_tf_errors
def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Allgathers of several tensors, negotiated together.

    Args:
        tensors: tensors in the same order on every member; each may differ across members in dim 0
            only.
        name: the collective's name, the same on every member; automatic if None.
        ignore_name_scope: accepted for Horovod's signature (names do not take the name scope).
        process_set: the ranks that take part (default: every rank).
    """
    if not tensors:
        return []
    tensors = [as_tensor(t, "grouped_allgather") for t in tensors]
    return _allgather(tensors, op_name("grouped_allgather", name, process_set), process_set)


def _allgather(tensors: list[tf.Tensor], name: str,
               process_set: ProcessSet) -> list[tf.Tensor]:
    def forward(*xs: tf.Tensor) -> list[tf.Tensor]:
        return ops.grouped_allgather(list(xs), name, process_set)

    def backward(dys: list[tf.Tensor]) -> list[tf.Tensor]:
        reduced = grouped_allreduce(dys, op=Average, process_set=process_set)
        return _own_rows(reduced, tensors, process_set)

    return differentiable(forward, backward, tensors)


def _own_rows(grads: list[tf.Tensor], inputs: list[tf.Tensor],
              process_set: ProcessSet) -> list[tf.Tensor]:
    """This rank's rows of each gathered gradient, given what each member contributed."""
    n, me = process_set.size(), process_set.rank()
    with tf.control_dependencies(grads):  # one collective after the other (a session)
        dims = tf.stack([tf.shape(x, out_type=tf.int32)[0] if x.shape.rank != 0 else 1
                         for x in inputs])
    every = tf.reshape(grouped_allgather([dims], process_set=process_set)[0], [n, len(inputs)])
    out = []
    for k, (g, x) in enumerate(zip(grads, inputs)):
        mine = tf.split(g, every[:, k], num=n, axis=0)[me]
        out.append(tf.reshape(mine, tf.shape(x)))
    return out


# ------------------------------------------------------------------------- broadcast
@raises_tf_errors
def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """`root_rank`'s tensor on every member (`root_rank` is a global rank).

    Args:
        tensor: the tensor; the root's is sent, and every member's has its shape and dtype.
        root_rank: the global rank whose value every member receives.
        name: the collective's name, the same on every member; automatic if None.
        ignore_name_scope: accepted for Horovod's signature (names do not take the name scope).
        process_set: the ranks that take part (default: every rank).
    """
    tensor = as_tensor(tensor, "broadcast")
    base = op_name(BROADCAST, name, process_set)

    def forward(x: tf.Tensor) -> list[tf.Tensor]:
        return ops.grouped_broadcast([x], root_rank, base, process_set)

    def backward(dys: list[tf.Tensor]) -> list[tf.Tensor]:
        reduced = allreduce(dys[0], op=Average, process_set=process_set)
        if runtime.rank() == root_rank:
            return [reduced]
        with tf.control_dependencies([reduced]):  # a graph must not prune the allreduce
            return [tf.zeros_like(reduced)]

    return differentiable(forward, backward, [tensor])[0]


@raises_tf_errors
def broadcast_(variables: Sequence[Any], root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Assigns `root_rank`'s values to `variables` in place, in one collective, and
    returns their new values.

    Args:
        variables: the variables, the same list on every member.
        root_rank: the global rank whose value every member receives.
        name: the collective's name, the same on every member; automatic if None.
        process_set: the ranks that take part (default: every rank).
    """
    variables = list(variables)
    values = ops.grouped_broadcast([tf.convert_to_tensor(v) for v in variables], root_rank,
                                   op_name("broadcast_", name, process_set), process_set)
    updates = [_assign(v, x) for v, x in zip(variables, values)]
    with tf.control_dependencies([u for u in updates if u is not None]):
        return [tf.identity(tf.convert_to_tensor(v)) for v in variables]


def _assign(variable: Any, value: tf.Tensor) -> Any:
    """`variable.assign(value)`: the op in a graph, None eagerly (already done)."""
    if isinstance(variable, tf.Variable):
        op = variable.assign(value, read_value=False)
    else:  # a Keras variable
        op = variable.assign(value)
    return None if tf.executing_eagerly() else op


# ------------------------------------------------------------------------- alltoall
@raises_tf_errors
def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> Any:
    """Rows `splits[i]` of dim 0 go to member i (an equal split if None). Returns the
    received rows; with `splits`, `(received, received_splits)` as Horovod does.

    Args:
        tensor: the rows to send, split along dim 0 by `splits`.
        splits: how many rows of dim 0 go to each member, in member order (equal parts if None).
        name: the collective's name, the same on every member; automatic if None.
        ignore_name_scope: accepted for Horovod's signature (names do not take the name scope).
        process_set: the ranks that take part (default: every rank).
    """
    tensor = as_tensor(tensor, "alltoall")
    base = op_name(ALLTOALL, name, process_set)
    received: list[tf.Tensor] = []

    def forward(x: tf.Tensor) -> list[tf.Tensor]:
        out, got = ops.alltoall(x, splits, base, process_set)
        received.append(got)
        return [out]

    def backward(dys: list[tf.Tensor]) -> list[tf.Tensor]:
        back, _ = alltoall(dys[0], received[0], process_set=process_set)
        return [back]

    (out,) = differentiable(forward, backward, [tensor])
    return (out, received[0]) if splits is not None else out


# ------------------------------------------------------------------------- reducescatter
@raises_tf_errors
def reducescatter(tensor: Any, device_dense: str = "", compression: Any = Compression.none,
                  op: str = Average, name: str | None = None,
                  process_set: ProcessSet = global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce-scatter along dim 0: member i gets its share of the reduced rows (the first
    `dim0 % size` members a row more). Ops: Average (default) and Sum.

    Args:
        tensor: the tensor to reduce; the same shape on every member, its dim 0 shared out.
        device_dense: accepted for Horovod's signature (the tensors stay where they are).
        compression: `Compression.fp16` sends floating-point tensors as float16 and casts back.
        op: Average (default) or Sum.
        name: the collective's name, the same on every member; automatic if None.
        process_set: the ranks that take part (default: every rank).
        ignore_name_scope: accepted for Horovod's signature (names do not take the name scope).
        prescale_factor: multiplies the input before the reduction (Sum and Average).
        postscale_factor: multiplies the result after the reduction (Sum and Average).
    """
    tensor = as_tensor(tensor, "reducescatter")
    with tf.device(device_dense):
        return _reducescatter([tensor], op_name(REDUCESCATTER, name, process_set), op, process_set,
                              prescale_factor, postscale_factor, compression)[0]


@raises_tf_errors
def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: Any = Compression.none, op: str = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          name: str | None = None) -> list[tf.Tensor]:
    """Reduce-scatters of several tensors, negotiated together.

    Args:
        tensors: tensors, in the same order, dtypes and shapes on every member.
        device_dense: accepted for Horovod's signature (the tensors stay where they are).
        compression: `Compression.fp16` sends floating-point tensors as float16 and casts back.
        op: Average (default) or Sum.
        process_set: the ranks that take part (default: every rank).
        prescale_factor: multiplies the input before the reduction (Sum and Average).
        postscale_factor: multiplies the result after the reduction (Sum and Average).
        name: the collective's name, the same on every member; automatic if None.
    """
    if not tensors:
        return []
    tensors = [as_tensor(t, "grouped_reducescatter") for t in tensors]
    with tf.device(device_dense):
        return _reducescatter(tensors, op_name("grouped_reducescatter", name, process_set), op,
                              process_set, prescale_factor, postscale_factor, compression)


def _reducescatter(tensors: list[tf.Tensor], name: str, op: str | None,
                   process_set: ProcessSet, pre: float, post: float,
                   compression: Any) -> list[tf.Tensor]:
    op = _core.resolve_op(op)

    def forward(*xs: tf.Tensor) -> list[tf.Tensor]:
        pairs = [compression.compress(x) for x in xs]
        outs = ops.grouped_reducescatter([c for c, _ in pairs], name, op, process_set,
                                         pre, post)
        return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]

    def backward(dys: list[tf.Tensor]) -> list[tf.Tensor]:
        scale = (process_set.size() if op == Sum else 1.0) * pre * post
        gathered = grouped_allgather(dys, process_set=process_set)
        return [g * tf.cast(scale, g.dtype) if scale != 1.0 else g for g in gathered]

    return differentiable(forward, backward, tensors)
