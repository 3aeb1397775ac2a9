"""Horovod's TensorFlow collectives on the raytrain-x engine, without gradients (the
differentiable public ops are in `raytrain_x.tensorflow.collectives`).

Each op works eagerly, inside `tf.function` and in a `tf.compat.v1` graph run by a session
(see `arrays.run_kernel`). Allreduces go
in chunks: TensorFlow concatenates each chunk's tensors into a fresh 64-byte aligned
buffer (the one copy), the engine reduces it in place, fusing the chunks of a cycle up to
the fusion threshold (the autotuned knob), and the results are views of the buffers.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from raytrain_x.common.errors import ConfigError
from raytrain_x.core import collectives as _core
from raytrain_x.core import runtime
from raytrain_x.core.collectives import Adasum, Average, Sum
from raytrain_x.core.process_sets import ProcessSet, registered_id
from raytrain_x.engine.messages import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BROADCAST,
    REDUCESCATTER,
    Handle,
    Meta,
)
from raytrain_x.tensorflow.arrays import (
    ALIGN,
    MOVED_AS,
    REDUCED_AS,
    aligned_empty,
    op_name,
    run_kernel,
    writable,
)
from raytrain_x.tensorflow.compression import Compressor
from raytrain_x.tensorflow.errors import NotSupportedError

FRAMEWORK = "tensorflow"


# ------------------------------------------------------------------------- chunks
# Dense allreduces travel in chunks of about this many bytes, fixed when a function is
# traced. Each chunk is submitted as soon as its tensors exist (inside `tf.function`, while
# backward still computes the others) and the engine fuses the chunks of a cycle up to the
# fusion threshold, the knob autotune moves.
CHUNK_BYTES = 4 << 20

# token -> (handle, what the engine reduces, the chunk's buffer): the two differ only when
# compression casts a non-float32 buffer, and the result is then copied back
_pending: dict[int, tuple[Handle, np.ndarray, np.ndarray]] = {}
_tokens = itertools.count()


def _chunks(tensors: Sequence[tf.Tensor]) -> list[list[int]]:
    """Consecutive same-dtype tensors, last first (backward produces the last layers'
    gradients first), up to `CHUNK_BYTES` each; a tensor of unknown size is a chunk."""
    chunks: list[list[int]] = []
    used = 0
    for i in reversed(range(len(tensors))):
        t = tensors[i]
        known = t.shape.is_fully_defined()
        nbytes = t.shape.num_elements() * t.dtype.size if known else CHUNK_BYTES
        if chunks and known and t.dtype == tensors[chunks[-1][0]].dtype \
                and used + nbytes <= CHUNK_BYTES:
            chunks[-1].append(i)
            used += nbytes
        else:
            chunks.append([i])
            used = nbytes
    return chunks


def _submit_chunk(flat: np.ndarray, shapes: np.ndarray, name: str, op: str, prescale: float,
                  postscale: float, process_set: ProcessSet,
                  compression: type[Compressor]) -> np.ndarray:
    """Queues the in-place allreduce of a chunk's buffer; returns a token for `_wait`."""
    flat = writable(flat)
    work, wire = flat, ""
    if compression.wire_dtype and flat.dtype.kind == "f" and flat.dtype != np.float16:
        if flat.dtype == np.float32:
            wire = compression.wire_dtype  # the native core casts while packing
        else:
            work = flat.astype(compression.wire_dtype)
    # the tensors' shapes go with the request (`_signature`)
    meta = Meta(ALLREDUCE, work.dtype.name, work.shape, op, 0, prescale, postscale,
                registered_id(process_set), wire, "cpu", splits=tuple(shapes.tolist()),
                framework=FRAMEWORK)
    token = next(_tokens)
    _pending[token] = (_core.submit(name, meta, work, output=work), work, flat)
    return np.array(token, dtype=np.int64)


def _wait(tokens: Sequence[np.ndarray], step: bool) -> None:
    """Waits for the chunks behind `tokens` (all of them, even after a failure)."""
    entries = [_pending.pop(int(t)) for t in tokens if int(t) in _pending]
    error = None
    for handle, work, flat in entries:
        try:
            handle.wait()
        except BaseException as exc:  # noqa: BLE001 - raised once all are waited for
            error = error or exc
            continue
        if work is not flat:
            flat[...] = work
    if error is not None:
        raise error
    if step:  # a gradient reduction: the end of a training step, for autotune
        runtime.mark_step()


def _tail_rows(pad: int, dtype: tf.DType, count: int) -> list[tf.Tensor]:
    """A row of zeros for the end of each of `count` chunks: it keeps a concatenation a
    fresh buffer even for one tensor (a lone input would be passed through, and the
    caller's tensor reduced in place). In a graph the rows are slices of one stateful op's
    output, which the graph optimizer never merges, so two reductions of the same tensors
    never share (and both write) one buffer."""
    if tf.executing_eagerly():
        return [tf.zeros([pad], dtype)] * count
    rows = tf.numpy_function(lambda: np.zeros(pad * count, dtype.as_numpy_dtype), [], dtype,
                             stateful=True)
    rows.set_shape([pad * count])
    return [rows[k * pad:(k + 1) * pad] for k in range(count)]


def _layout(members: list[tf.Tensor], pad: int) -> tuple[list[Any], list[Any]]:
    """Each tensor flattened and padded to whole rows, and its element count: Python
    numbers when the shapes are known at trace time (fewer graph ops), tensors otherwise."""
    if all(t.shape.is_fully_defined() for t in members):
        sizes = [t.shape.num_elements() for t in members]
        pieces = [tf.reshape(t, [-1]) if n % pad == 0 else
                  tf.pad(tf.reshape(t, [-1]), [[0, -n % pad]]) for t, n in zip(members, sizes)]
        return pieces, sizes
    sizes = [tf.size(t, out_type=tf.int64) for t in members]
    pieces = [tf.pad(tf.reshape(t, [-1]), [[0, (-n) % pad]]) for t, n in zip(members, sizes)]
    return pieces, sizes


def _signature(members: list[tf.Tensor]) -> tf.Tensor:
    """The chunk's tensors' shapes, each as its rank and its dims, in one int64 vector: it
    goes with the request, so ranks whose tensors differ in shape get a mismatch error
    (as in Horovod) instead of a reduced concatenation."""
    if all(t.shape.is_fully_defined() for t in members):
        return tf.constant([v for t in members for v in (t.shape.rank, *t.shape.as_list())],
                           tf.int64)
    return tf.concat([tf.concat([[tf.rank(t)], tf.shape(t)], 0) for t in members], 0)


def grouped_reduce(tensors: Sequence[tf.Tensor], name: str, op: str, prescale: float,
                   postscale: float, process_set: ProcessSet, compression: type[Compressor],
                   step: bool = False) -> list[tf.Tensor]:
    """Allreduce of dense tensors of any dtypes.

    Per chunk (see `CHUNK_BYTES`), TensorFlow concatenates the tensors, each padded to a
    64-byte row, into a fresh buffer: the one copy of the path, made by TensorFlow's own
    kernel. A numpy kernel queues the in-place reduction of that buffer and returns at
    once; a last kernel waits for every chunk. Nothing comes back through
    `tf.numpy_function` but tokens. Each result is a view of its chunk's buffer: split along
    rows (TensorFlow shares memory for aligned splits) and reshaped; only a tensor whose
    size is not a multiple of a row is sliced, a copy of it.
    """
    if not tensors:
        return []
    dtypes = [t.dtype for t in tensors]
    work = [tf.cast(t, REDUCED_AS[t.dtype]) if t.dtype in REDUCED_AS else t for t in tensors]
    # Adasum combines each tensor on its own (its coefficients are per tensor)
    chunks = _chunks(work) if op != Adasum else [[i] for i in reversed(range(len(work)))]
    tails: dict[tf.DType, list[tf.Tensor]] = {}
    for d in {work[m[0]].dtype for m in chunks}:
        tails[d] = _tail_rows(ALIGN // d.size, d,
                              sum(1 for m in chunks if work[m[0]].dtype == d))
    buffers, tokens = [], []
    for k, members in enumerate(chunks):
        d = work[members[0]].dtype
        pad = ALIGN // d.size
        pieces, sizes = _layout([work[i] for i in members], pad)
        signature = _signature([work[i] for i in members])
        flat = tf.concat([*pieces, tails[d].pop()], 0)
        chunk_name = name if len(chunks) == 1 else f"{name}.{k}"

        def submit(a, n, chunk_name=chunk_name):
            return [_submit_chunk(a, n, chunk_name, op, prescale, postscale, process_set,
                                  compression)]

        tokens += run_kernel(submit, [flat, tf.cast(signature, tf.int64)], [tf.int64],
                             [tf.TensorShape([])],
                             waits=False)
        buffers.append((flat, sizes, pad))

    def wait(*inputs: np.ndarray) -> list[np.ndarray]:
        _wait(inputs[:len(tokens)], step)
        return [np.zeros((), np.int32)]

    # the buffers are inputs of the wait too: TensorFlow keeps them (the engine writes
    # into them) until the wait is done, whatever becomes of the submits' inputs
    (done,) = run_kernel(wait, [*tokens, *[b[0] for b in buffers]], [tf.int32],
                         [tf.TensorShape([])])
    out: list[Any] = [None] * len(work)
    for members, (flat, sizes, pad) in zip(chunks, buffers):
        with tf.control_dependencies([done]):  # read the buffer after the engine wrote it
            flat = tf.identity(flat)
        rows = [(n + pad - 1) // pad for n in sizes] + [1]
        if any(isinstance(r, tf.Tensor) for r in rows):
            rows = tf.stack([tf.cast(r, tf.int64) for r in rows])
        parts = tf.split(tf.reshape(flat, [-1, pad]), rows, num=len(members) + 1)
        for i, n, part in zip(members, sizes, parts):
            t = work[i]
            if t.shape.is_fully_defined() and t.shape.num_elements() % pad == 0:
                result = tf.reshape(part, t.shape)  # a view: no copy
            else:
                result = tf.reshape(tf.reshape(part, [-1])[:n], tf.shape(t))
                result.set_shape(t.shape)
            out[i] = tf.cast(result, dtypes[i]) if dtypes[i] in REDUCED_AS else result
    return out


# ------------------------------------------------------------------------- checks
def reduce_scales(op: str, prescale: float, postscale: float,
                  tensors: Sequence[tf.Tensor]) -> tuple[float, float]:
    """The factors of a reduction, checked against its op and dtypes."""
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
    base = op_name("sparse_allreduce", name)
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
