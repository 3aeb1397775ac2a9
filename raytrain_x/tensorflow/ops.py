"""Horovod's TensorFlow collectives on the raytrain-x engine, without gradients (the
differentiable public ops are in `raytrain_x.tensorflow.collectives`).

Each op works eagerly, inside `tf.function` and in a `tf.compat.v1` graph run by a session
(see `arrays.run_kernel`). Allreduces go
in chunks: TensorFlow concatenates each chunk's tensors into a fresh 64-byte aligned
buffer (the one copy), the engine reduces it in place, fusing the chunks of a cycle up to
the fusion threshold (the autotuned knob), and the results are views of the buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from raytrain_x.common.errors import ConfigError
from raytrain_x.core import collectives as _core
from raytrain_x.core.collectives import Average, Sum
from raytrain_x.core.process_sets import ProcessSet, registered_id
from raytrain_x.engine.messages import (
    ALLGATHER,
    ALLTOALL,
    BROADCAST,
    REDUCESCATTER,
    Meta,
)
from raytrain_x.tensorflow.arrays import (
    MOVED_AS,
    REDUCED_AS,
    aligned_empty,
    op_name,
    run_kernel,
)
from raytrain_x.tensorflow.errors import NotSupportedError

FRAMEWORK = "tensorflow"


# ------------------------------------------------------------------------- checks
def reduce_scales(op: str, prescale: float, postscale: float,
                  tensors: Sequence[tf.Tensor]) -> tuple[float, float]:
    """The factors of a reduction, checked against its op and dtypes."""
    prescale = _core.scale_factor("prescale_factor", prescale)
    postscale = _core.scale_factor("postscale_factor", postscale)
    if any(t.dtype == tf.bool for t in tensors):
        if op == Average or prescale != 1.0 or postscale != 1.0:
            raise ConfigError("a bool allreduce takes Sum or Max (logical or), Min or Product "
                              "(logical and), without scale factors; cast to a number dtype "
                              "to average")
        return 1.0, 1.0
    if prescale == 1.0 and postscale == 1.0:
        return 1.0, 1.0
    if op not in (Average, Sum):
        raise ConfigError("prescale_factor/postscale_factor apply to Sum and Average only")
    # integer tensors are scaled in float64 and cast back, as Horovod does (the engine)
    return float(prescale), float(postscale)


def _to_wire(tensor: tf.Tensor) -> tf.Tensor:
    """What a data-moving collective sends for `tensor`: dtypes without a numpy twin the
    engine moves (bfloat16, int16, uint16: their bits as float16; bool: as uint8)."""
    carrier = MOVED_AS.get(tensor.dtype)
    if carrier is None:
        return tensor
    return tf.cast(tensor, carrier) if tensor.dtype == tf.bool else tf.bitcast(tensor, carrier)


def _from_wire(tensor: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    if dtype not in MOVED_AS:
        return tensor
    return tf.cast(tensor, dtype) if dtype == tf.bool else tf.bitcast(tensor, dtype)


def _leading_unknown(shape: tf.TensorShape) -> tf.TensorShape | None:
    """`shape` with dim 0 unknown (a scalar becomes a vector), None for an unknown rank."""
    if shape.rank is None:
        return None
    return tf.TensorShape([None]).concatenate(shape[1:])


# ------------------------------------------------------------------------- data movers
def allreduce_sparse(slices: tf.IndexedSlices, name: str | None, op: str,
                     process_set: ProcessSet) -> tf.IndexedSlices:
    """Horovod's sparse allreduce: gather every member's rows and indices (duplicates are
    summed by whoever applies them); Average divides the values by the set's size."""
    if op not in (Average, Sum):
        raise NotSupportedError("an IndexedSlices allreduce supports Average and Sum only; use "
                          "sparse_as_dense=True for other ops")
    base = op_name("sparse_allreduce", name, process_set)
    values, indices = grouped_allgather([slices.values, slices.indices], base, process_set)
    if op == Average:
        values = values / tf.cast(process_set.size(), values.dtype)
    return tf.IndexedSlices(values, indices, slices.dense_shape)


def grouped_allgather(tensors: Sequence[tf.Tensor], name: str,
                      process_set: ProcessSet) -> list[tf.Tensor]:
    """Each tensor's members' rows concatenated along dim 0 in rank order, in one kernel
    (negotiated together). A scalar is gathered as a 1-element vector."""
    dtypes = [t.dtype for t in tensors]
    sent = [_to_wire(t) for t in tensors]
    pset_id = registered_id(process_set)

    def kernel(*arrays: np.ndarray) -> list[np.ndarray]:
        requests = []
        for i, a in enumerate(arrays):
            a = a.reshape(1) if a.ndim == 0 else a
            meta = Meta(ALLGATHER, a.dtype.name, a.shape, process_set_id=pset_id,
                        framework=FRAMEWORK)
            requests.append(_core.request(_member(name, i, len(arrays)), meta, a))
        _core.submit_many(requests)
        return _wait_all(requests)

    outs = run_kernel(kernel, sent, [t.dtype for t in sent],
                      [_leading_unknown(t.shape) for t in sent])
    return [_from_wire(o, d) for o, d in zip(outs, dtypes)]


def grouped_broadcast(tensors: Sequence[tf.Tensor], root_rank: int, name: str,
                      process_set: ProcessSet) -> list[tf.Tensor]:
    """`root_rank`'s tensors on every member, in one kernel."""
    members = process_set.ranks
    if members is not None and root_rank not in members:
        raise ConfigError(f"broadcast root_rank {root_rank} is not in the process set {members}")
    dtypes = [t.dtype for t in tensors]
    sent = [_to_wire(t) for t in tensors]
    pset_id = registered_id(process_set)

    def kernel(*arrays: np.ndarray) -> list[np.ndarray]:
        requests = []
        for i, a in enumerate(arrays):
            work = aligned_empty(a.shape, a.dtype)
            work[...] = a
            meta = Meta(BROADCAST, a.dtype.name, a.shape, root=int(root_rank),
                        process_set_id=pset_id, framework=FRAMEWORK)
            requests.append(_core.request(_member(name, i, len(arrays)), meta, work, work))
        _core.submit_many(requests)
        return _wait_all(requests)

    outs = run_kernel(kernel, sent, [t.dtype for t in sent], [t.shape for t in sent])
    return [_from_wire(o, d) for o, d in zip(outs, dtypes)]


def alltoall(tensor: tf.Tensor, splits: Any, name: str,
             process_set: ProcessSet) -> tuple[tf.Tensor, tf.Tensor]:
    """Rows `splits[i]` of dim 0 go to member i (an equal split if None). Returns the
    received rows and how many came from each member."""
    n = process_set.size()
    dtype, sent = tensor.dtype, _to_wire(tensor)
    pset_id = registered_id(process_set)
    if splits is None:
        dim0 = tensor.shape[0] if tensor.shape.rank else 0
        if tensor.shape.rank == 0 or (dim0 is not None and dim0 % n):
            raise ConfigError(f"alltoall without splits needs dim 0 ({tensor.shape}) "
                              f"divisible by the {n} members; pass splits=")
    split_tensor = tf.zeros([0], tf.int32) if splits is None else tf.cast(
        tf.convert_to_tensor(splits), tf.int32)

    def kernel(a: np.ndarray, s: np.ndarray) -> list[np.ndarray]:
        if splits is None:
            split_list = [a.shape[0] // n] * n
        else:
            split_list = [int(v) for v in s.reshape(-1)]
            if len(split_list) != n or any(v < 0 for v in split_list) \
                    or sum(split_list) != a.shape[0]:
                raise ConfigError(f"alltoall splits {split_list} must be {n} non-negative "
                                  f"numbers summing to dim 0 ({a.shape[0]})")
        meta = Meta(ALLTOALL, a.dtype.name, a.shape, process_set_id=pset_id,
                    splits=tuple(split_list), framework=FRAMEWORK)
        out, received = _core.synchronize(_core.submit(name, meta, np.ascontiguousarray(a)))
        return [out, received.astype(np.int32)]

    out, received = run_kernel(kernel, [sent, split_tensor], [sent.dtype, tf.int32],
                               [_leading_unknown(sent.shape), tf.TensorShape([n])])
    return _from_wire(out, dtype), received


def grouped_reducescatter(tensors: Sequence[tf.Tensor], name: str, op: str,
                          process_set: ProcessSet, prescale: float,
                          postscale: float) -> list[tf.Tensor]:
    """Reduce-scatter of each tensor along dim 0, in one kernel: member i gets its share of
    the reduced rows (the first `dim0 % size` members a row more)."""
    if op not in (Average, Sum):
        raise ConfigError("reducescatter supports rx.Average and rx.Sum")
    for t in tensors:
        if t.shape.rank == 0:
            raise ConfigError("reducescatter needs tensors with at least one dimension")
        if t.dtype == tf.bool:
            raise ConfigError("reducescatter of bool tensors is not defined; cast to a "
                              "number dtype")
    pre, post = reduce_scales(op, prescale, postscale, tensors)
    dtypes = [t.dtype for t in tensors]
    work = [tf.cast(t, REDUCED_AS[t.dtype]) if t.dtype in REDUCED_AS else t for t in tensors]
    pset_id = registered_id(process_set)

    def kernel(*arrays: np.ndarray) -> list[np.ndarray]:
        requests = []
        for i, a in enumerate(arrays):
            meta = Meta(REDUCESCATTER, a.dtype.name, a.shape, op, 0, pre, post, pset_id,
                        framework=FRAMEWORK)
            requests.append(_core.request(_member(name, i, len(arrays)), meta,
                                          np.ascontiguousarray(a)))
        _core.submit_many(requests)
        return _wait_all(requests)

    outs = run_kernel(kernel, work, [w.dtype for w in work],
                      [_leading_unknown(w.shape) for w in work])
    return [tf.cast(o, d) if d in REDUCED_AS else o for o, d in zip(outs, dtypes)]


def _member(name: str, i: int, count: int) -> str:
    return name if count == 1 else f"{name}.{i}"


def _wait_all(requests: list[Any]) -> list[np.ndarray]:
    """Every request's result once all finished; the first error after all are waited."""
    results, error = [], None
    for req in requests:
        try:
            results.append(req.handle.wait())
        except BaseException as exc:  # noqa: BLE001 - raised once all are waited for
            error = error or exc
    if error is not None:
        raise error
    return results
