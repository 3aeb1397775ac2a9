"""Horovod's TensorFlow collectives on the raytrain-x engine.

Each op works eagerly and inside `tf.function` (see `arrays.run_kernel`). Allreduces lay
their tensors out in flat, 64-byte aligned buckets of at most the fusion threshold (the
autotuned knob), reduce each bucket in place with one collective, and hand back views of
the buckets as tensors: one copy in, none out. Ranks agree on the bucket size as the torch
face's `DistributedOptimizer` does: from the knobs in effect before the cycle of the
previous bucketed reduction, a cycle number every rank shares.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from raytrain_x.autotune.sampler import BATCHING_BUCKETS
from raytrain_x.common.errors import ConfigError
from raytrain_x.core import collectives as _core
from raytrain_x.core import runtime
from raytrain_x.core.collectives import Average, Sum
from raytrain_x.core.process_sets import ProcessSet, global_process_set, registered_id
from raytrain_x.engine.messages import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BROADCAST,
    REDUCESCATTER,
    Meta,
)
from raytrain_x.tensorflow.arrays import (
    ALIGN,
    aligned_empty,
    as_tensor,
    op_name,
    run_kernel,
)
from raytrain_x.tensorflow.compression import Compression, Compressor

FRAMEWORK = "tensorflow"


# ------------------------------------------------------------------------- buckets
class _BucketSize:
    """The bucket size every rank uses for its next bucketed allreduce."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.last_cycle = -1

    def bytes(self) -> int:
        engine = runtime.engine()
        if engine is not self.engine:  # a new world (elastic reset): cycles start again
            self.engine, self.last_cycle = engine, -1
            runtime.note_batching(BATCHING_BUCKETS)  # autotune: the knob sizes buckets
        return engine.knobs_before(max(self.last_cycle, 0)).fusion_threshold_bytes


_bucket_size = _BucketSize()


class _BufferPool:
    """Aligned flat buffers reused across steps. A buffer is handed out again only when
    nothing but the pool refers to it: TensorFlow keeps a reference to every array it
    adopted, so a gradient tensor still alive keeps its buffer out of reuse. Reusing saves
    the page faults of a fresh allocation, which cost as much as a copy."""

    def __init__(self, keep: int = 4) -> None:
        self._free: dict[tuple[int, str], list[np.ndarray]] = {}
        self._keep = keep

    def get(self, count: int, dtype: np.dtype) -> np.ndarray:
        buffers = self._free.setdefault((count, dtype.str), [])
        for buf in buffers:
            if sys.getrefcount(buf) <= 3:  # the list, this loop, getrefcount's argument
                return buf
        buf = aligned_empty((count,), dtype)
        buffers.append(buf)
        del buffers[:-self._keep]
        return buf


_pool = _BufferPool()


def _offsets(sizes: Sequence[int], pad: int) -> tuple[list[int], int]:
    """Element offsets of arrays laid end to end, each starting on a multiple of `pad`."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // pad) * pad
    return offsets, total


def _buckets(offsets: list[int], total: int, itemsize: int, cap_bytes: int) -> list[tuple]:
    """Contiguous (start, end, first array, last array + 1) regions of at most `cap_bytes`
    (a lone larger array is a region of its own; 0: one region per array)."""
    regions: list[tuple] = []
    start, first = 0, 0
    bounds = offsets[1:] + [total]
    for i, end in enumerate(bounds):
        if i > first and (cap_bytes <= 0 or (end - start) * itemsize > cap_bytes):
            regions.append((start, offsets[i], first, i))
            start, first = offsets[i], i
    regions.append((start, total, first, len(offsets)))
    return regions


def reduce_flat(arrays: Sequence[np.ndarray], pad: int, name: str, op: str,
                prescale: float, postscale: float, process_set: ProcessSet,
                compression: type[Compressor]) -> np.ndarray:
    """Allreduces same-dtype arrays laid out in one aligned flat buffer (each starting on a
    multiple of `pad` elements), in buckets of at most the fusion threshold, each reduced
    in place by one collective. Returns the flat buffer of results."""
    dtype = arrays[0].dtype
    work_dtype, wire = dtype, ""
    if compression.wire_dtype and dtype.kind == "f" and dtype != np.float16:
        if dtype == np.float32:
            wire = compression.wire_dtype  # the native core casts while packing
        else:
            work_dtype = np.dtype(compression.wire_dtype)
    sizes = [a.size for a in arrays]
    offsets, total = _offsets(sizes, pad)
    flat = _pool.get(total, work_dtype)
    end = 0
    for a, offset in zip(arrays, offsets):
        if offset > end:
            flat[end:offset] = 0
        np.copyto(flat[offset:offset + a.size], a.reshape(-1), casting="unsafe")
        end = offset + a.size
    flat[end:] = 0
    regions = _buckets(offsets, total, work_dtype.itemsize, _bucket_size.bytes())
    pset_id = registered_id(process_set)
    requests = []
    for b, (start, stop, first, last) in enumerate(regions):
        # the element counts go with the request, so ranks whose tensors differ get a
        # mismatch error instead of a silently reduced concatenation
        meta = Meta(ALLREDUCE, work_dtype.name, (stop - start,), op, 0, prescale, postscale,
                    pset_id, wire, "cpu", splits=tuple(sizes[first:last]), fuse=False,
                    framework=FRAMEWORK)
        region = flat[start:stop]
        requests.append(_core.request(name if len(regions) == 1 else f"{name}.b{b}", meta,
                                      region, output=region))
    _core.submit_many(requests)
    for req in requests:
        req.handle.wait()
    _bucket_size.last_cycle = max(req.handle.cycle for req in requests)
    if work_dtype != dtype:
        out = _pool.get(total, dtype)
        out[...] = flat
        return out
    return flat


def _reduce_scales(op: str, prescale: float, postscale: float,
                   tensors: Sequence[tf.Tensor]) -> tuple[float, float]:
    if prescale == 1.0 and postscale == 1.0:
        return 1.0, 1.0
    if op not in (Average, Sum):
        raise ConfigError("prescale_factor/postscale_factor apply to Sum and Average only")
    if any(t.dtype.is_integer for t in tensors) and \
            not (float(prescale).is_integer() and float(postscale).is_integer()):
        raise ConfigError("integer tensors take whole prescale/postscale factors only, got "
                          f"{prescale} and {postscale}; cast to a float dtype first")
    return float(prescale), float(postscale)


def grouped_reduce(tensors: Sequence[tf.Tensor], name: str, op: str, prescale: float,
                   postscale: float, process_set: ProcessSet, compression: type[Compressor],
                   step: bool = False) -> list[tf.Tensor]:
    """Allreduce of dense tensors of any dtypes in one kernel call (one graph op).

    The kernel returns one flat buffer per dtype, adopted by TensorFlow without a copy;
    each tensor is then a view of it: split along rows of 64 bytes (TensorFlow shares
    memory for aligned splits) and reshaped. Only a tensor whose size is not a multiple of
    a row is sliced, which copies that tensor."""
    if not tensors:
        return []
    dtypes = [t.dtype for t in tensors]
    # bfloat16 has no numpy dtype: it is reduced in float32 and cast back
    work = [tf.cast(t, tf.float32) if t.dtype == tf.bfloat16 else t for t in tensors]
    groups: dict[tf.DType, list[int]] = {}
    for i, t in enumerate(work):
        groups.setdefault(t.dtype, []).append(i)
    order = sorted(groups, key=lambda d: d.name)
    pads = {d: ALIGN // d.size for d in order}

    def kernel(*arrays: np.ndarray) -> list[np.ndarray]:
        outs, start = [], 0
        for d in order:
            count = len(groups[d])
            group = name if len(order) == 1 else f"{name}.{d.name}"
            outs.append(reduce_flat(arrays[start:start + count], pads[d], group, op, prescale,
                                    postscale, process_set, compression))
            start += count
        if step:  # a gradient reduction: the end of a training step, for autotune
            runtime.mark_step()
        return outs

    inputs = [work[i] for d in order for i in groups[d]]
    flats = run_kernel(kernel, inputs, order, [tf.TensorShape([None])] * len(order))
    out: list[Any] = [None] * len(work)
    for d, flat in zip(order, flats):
        pad = pads[d]
        members = [work[i] for i in groups[d]]
        sizes = [tf.size(t, out_type=tf.int64) for t in members]
        rows = tf.stack([(n + pad - 1) // pad for n in sizes])
        parts = tf.split(tf.reshape(flat, [-1, pad]), rows, num=len(members))
        for i, t, n, part in zip(groups[d], members, sizes, parts):
            values = tf.reshape(part, [-1])
            if t.shape.is_fully_defined() and t.shape.num_elements() % pad == 0:
                result = tf.reshape(values, t.shape)  # a view: no copy
            else:
                result = tf.reshape(values[:n], tf.shape(t))
                result.set_shape(t.shape)
            out[i] = tf.cast(result, dtypes[i]) if dtypes[i] == tf.bfloat16 else result
    return out


# ------------------------------------------------------------------------- allreduce
def allreduce(tensor: Any, average: bool | None = None, name: str | None = None,
              op: str | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
              compression: type[Compressor] = Compression.none) -> tf.Tensor:
    """Allreduce of `tensor` across the process set (default op: Average).

    Args:
        tensor: a dense tensor (or a tf.IndexedSlices, reduced by allgather as in Horovod).
        average: deprecated Horovod flag; use `op`.
        name: unique name of this collective, the same on every rank; automatic if None.
        op: Average, Sum, Min, Max or Product.
        prescale_factor, postscale_factor: multiply before / after the reduction.
        process_set: ranks that take part.
        compression: `Compression.fp16` sends floating point tensors as float16.
    """
    op = _core.resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_sparse(tensor, name, op, process_set)
    tensor = as_tensor(tensor, "allreduce")
    pre, post = _reduce_scales(op, prescale_factor, postscale_factor, [tensor])
    return grouped_reduce([tensor], op_name(ALLREDUCE, name), op, pre, post, process_set,
                          compression)[0]


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None,
                      name: str | None = None, op: str | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      compression: type[Compressor] = Compression.none) -> list[tf.Tensor]:
    """Allreduces of several tensors, fused into buckets up to the fusion threshold."""
    op = _core.resolve_op(op, average)
    dense = [as_tensor(t, "grouped_allreduce") for t in tensors]
    pre, post = _reduce_scales(op, prescale_factor, postscale_factor, dense)
    return grouped_reduce(dense, op_name("grouped_allreduce", name), op, pre, post,
                          process_set, compression)


def _allreduce_sparse(slices: tf.IndexedSlices, name: str | None, op: str,
                      process_set: ProcessSet) -> tf.IndexedSlices:
    """Horovod's sparse allreduce: gather every member's rows and indices (duplicates are
    summed by whoever applies them); Average divides the values by the set's size."""
    if op not in (Average, Sum):
        raise ConfigError("an IndexedSlices allreduce supports Average and Sum only; use "
                          "sparse_as_dense=True for other ops")
    base = op_name("sparse_allreduce", name)
    values = allgather(slices.values, f"{base}.values", process_set)
    indices = allgather(slices.indices, f"{base}.indices", process_set)
    if op == Average:
        values = values / tf.cast(process_set.size(), values.dtype)
    return tf.IndexedSlices(values, indices, slices.dense_shape)


# ------------------------------------------------------------------------- others
def _bits(tensor: tf.Tensor) -> tf.Tensor:
    """Data-moving collectives send bfloat16 as its bits (float16 has the same width)."""
    return tf.bitcast(tensor, tf.float16) if tensor.dtype == tf.bfloat16 else tensor


def _unbits(tensor: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    return tf.bitcast(tensor, tf.bfloat16) if dtype == tf.bfloat16 else tensor


def allgather(tensor: Any, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Every member's tensor concatenated along dim 0, in rank order; members may differ
    in dim 0, not in the other dims. A scalar is gathered as a 1-element vector."""
    tensor = as_tensor(tensor, "allgather")
    dtype, sent = tensor.dtype, _bits(tensor)
    name = op_name(ALLGATHER, name)
    pset_id = registered_id(process_set)

    def kernel(a: np.ndarray) -> list[np.ndarray]:
        a = a.reshape(1) if a.ndim == 0 else a
        meta = Meta(ALLGATHER, a.dtype.name, a.shape, process_set_id=pset_id,
                    framework=FRAMEWORK)
        return [_core.synchronize(_core.submit(name, meta, a))]

    rest = sent.shape[1:] if sent.shape.rank else []
    out = run_kernel(kernel, [sent], [sent.dtype], [tf.TensorShape([None]).concatenate(rest)
                                                    if sent.shape.rank is not None else None])
    return _unbits(out[0], dtype)


def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """`root_rank`'s tensor on every member (global rank)."""
    tensor = as_tensor(tensor, "broadcast")
    members = process_set.ranks
    if members is not None and root_rank not in members:
        raise ConfigError(f"broadcast root_rank {root_rank} is not in the process set {members}")
    dtype, sent = tensor.dtype, _bits(tensor)
    name = op_name(BROADCAST, name)
    pset_id = registered_id(process_set)

    def kernel(a: np.ndarray) -> list[np.ndarray]:
        work = aligned_empty(a.shape, a.dtype)
        work[...] = a
        meta = Meta(BROADCAST, a.dtype.name, a.shape, root=int(root_rank),
                    process_set_id=pset_id, framework=FRAMEWORK)
        return [_core.synchronize(_core.submit(name, meta, work, output=work))]

    return _unbits(run_kernel(kernel, [sent], [sent.dtype], [sent.shape])[0], dtype)


def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Rows `splits[i]` of dim 0 go to member i (an equal split if None). Returns the
    received rows; with `splits`, `(received, received_splits)` as Horovod does."""
    tensor = as_tensor(tensor, "alltoall")
    n = process_set.size()
    dtype, sent = tensor.dtype, _bits(tensor)
    name = op_name(ALLTOALL, name)
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

    shape = tf.TensorShape([None]).concatenate(sent.shape[1:]) \
        if sent.shape.rank is not None else None
    out, received = run_kernel(kernel, [sent, split_tensor], [sent.dtype, tf.int32],
                               [shape, tf.TensorShape([n])])
    out = _unbits(out, dtype)
    return (out, received) if splits is not None else out


def reducescatter(tensor: Any, name: str | None = None, op: str | None = None,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce-scatter along dim 0: member i gets its share of the reduced rows (the first
    `dim0 % size` members a row more). Ops: Average and Sum."""
    tensor = as_tensor(tensor, "reducescatter")
    op = _core.resolve_op(op, None)
    if op not in (Average, Sum):
        raise ConfigError("reducescatter supports rx.Average and rx.Sum")
    if tensor.shape.rank == 0:
        raise ConfigError("reducescatter needs a tensor with at least one dimension")
    dtype = tensor.dtype
    work = tf.cast(tensor, tf.float32) if dtype == tf.bfloat16 else tensor
    name = op_name(REDUCESCATTER, name)
    pset_id = registered_id(process_set)

    def kernel(a: np.ndarray) -> list[np.ndarray]:
        meta = Meta(REDUCESCATTER, a.dtype.name, a.shape, op, 0, float(prescale_factor),
                    float(postscale_factor), pset_id, framework=FRAMEWORK)
        return [_core.synchronize(_core.submit(name, meta, np.ascontiguousarray(a)))]

    shape = tf.TensorShape([None]).concatenate(work.shape[1:]) \
        if work.shape.rank is not None else None
    out = run_kernel(kernel, [work], [work.dtype], [shape])[0]
    return tf.cast(out, dtype) if dtype == tf.bfloat16 else out
