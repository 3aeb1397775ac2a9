"""The TensorFlow face's dense allreduces, in units (`gradient_layout`): each unit's tensors
are concatenated into a fresh 64-byte aligned buffer (the one copy), the engine reduces it
in place, fusing the units of a cycle up to the fusion threshold (the autotuned knob), and
the results are views of the buffers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from raytrain_x.common.process import next_number
from raytrain_x.core import collectives as _core
from raytrain_x.core import runtime
from raytrain_x.core.process_sets import ProcessSet, registered_id
from raytrain_x.engine.messages import (
    ALLREDUCE,
    Meta,
)
from raytrain_x.tensorflow import kernels
from raytrain_x.tensorflow.arrays import (
    ALIGN,
    REDUCED_AS,
    run_kernel,
    writable,
)
from raytrain_x.tensorflow.compression import Compressor
from raytrain_x.tensorflow.gradient_layout import units
from raytrain_x.tensorflow.ops import FRAMEWORK
from raytrain_x.tensorflow.process import tf_process


def _submit_unit(flat: np.ndarray, shapes: np.ndarray, name: str, op: str, prescale: float,
                  postscale: float, process_set: ProcessSet,
                  compression: type[Compressor]) -> np.ndarray:
    """Queues the in-place allreduce of a unit's buffer; returns a token for `_wait`."""
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
    # token -> (handle, what the engine reduces, the unit's buffer): the two differ only
    # when compression casts a non-float32 buffer, and the result is then copied back
    token, pending = next_number("tf.unit"), tf_process().pending
    pending[token] = (_core.submit(name, meta, work, output=work), work, flat)
    return np.array(token, dtype=np.int64)


def _wait(tokens: Sequence[np.ndarray], step: bool) -> None:
    """Waits for the units behind `tokens` (all of them, even after a failure)."""
    pending = tf_process().pending
    entries = [pending.pop(int(t)) for t in tokens if int(t) in pending]
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
    """A row of zeros for the end of each of `count` units: it keeps a concatenation a
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


def _sizes(members: list[tf.Tensor]) -> list[Any]:
    """Each tensor's element count: Python numbers when the shapes are known at trace time
    (fewer graph ops), tensors otherwise."""
    if all(t.shape.is_fully_defined() for t in members):
        return [t.shape.num_elements() for t in members]
    return [tf.size(t, out_type=tf.int64) for t in members]


def _padded(members: list[tf.Tensor], sizes: list[Any], pad: int) -> list[tf.Tensor]:
    """Each tensor flattened and padded to whole rows (for TensorFlow's concatenation)."""
    return [tf.reshape(t, [-1]) if isinstance(n, int) and n % pad == 0 else
            tf.pad(tf.reshape(t, [-1]), [[0, (-n) % pad]]) for t, n in zip(members, sizes)]


def _signature(members: list[tf.Tensor]) -> tf.Tensor:
    """The unit's tensors' shapes, each as its rank and its dims, in one int64 vector: it
    goes with the request, so ranks whose tensors differ in shape get a mismatch error
    (as in Horovod) instead of a reduced concatenation."""
    if all(t.shape.is_fully_defined() for t in members):
        return tf.constant([v for t in members for v in (t.shape.rank, *t.shape.as_list())],
                           tf.int64)
    return tf.concat([tf.concat([[tf.rank(t)], tf.shape(t)], 0) for t in members], 0)


def grouped_reduce(tensors: Sequence[tf.Tensor], name: str, op: str, prescale: float,
                   postscale: float, process_set: ProcessSet, compression: type[Compressor],
                   step: bool = False, groups: Any = None,
                   sources: Sequence[Any] | None = None) -> list[tf.Tensor]:
    """Allreduce of dense tensors of any dtypes, in the units `gradient_layout.units` cuts
    (with Horovod's `groups` over the tensors' `sources`).

    Per unit, the tensors are concatenated, each padded to a 64-byte row, into a fresh
    buffer: the one copy of the path, made inside a graph by raytrain-x's own op
    (`kernels.concat`, which the executor runs as soon as the unit exists), eagerly or
    without that op by TensorFlow's. A numpy kernel queues the in-place reduction of that
    buffer and returns at once; a last kernel waits for every unit. Nothing comes back
    through `tf.numpy_function` but tokens. Each result is a view of its unit's buffer:
    split along rows (TensorFlow shares memory for aligned splits) and reshaped; only a
    tensor whose size is not a multiple of a row is sliced, a copy of it.
    """
    if not tensors:
        return []
    dtypes = [t.dtype for t in tensors]
    work = [tf.cast(t, REDUCED_AS[t.dtype]) if t.dtype in REDUCED_AS else t for t in tensors]
    cut = units(work, name, op, groups, sources)
    # in a graph the units are laid out by raytrain-x's own op where it is built: the
    # executor runs it as soon as the unit exists (kernels.concat)
    own_concat = not tf.executing_eagerly() and kernels.available()
    tails: dict[tf.DType, list[tf.Tensor]] = {}
    if not own_concat:
        for d in {work[u.members[0]].dtype for u in cut}:
            tails[d] = _tail_rows(ALIGN // d.size, d,
                                  sum(1 for u in cut if work[u.members[0]].dtype == d))
    buffers, tokens = [], []
    for unit in cut:
        d = work[unit.members[0]].dtype
        pad = ALIGN // d.size
        tensors_of = [work[i] for i in unit.members]
        sizes = _sizes(tensors_of)
        if own_concat:
            flat, signature = kernels.concat(tensors_of, pad)
        else:
            signature = _signature(tensors_of)
            flat = tf.concat([*_padded(tensors_of, sizes, pad), tails[d].pop()], 0)

        def submit(a, n, unit_name=unit.name):
            return [_submit_unit(a, n, unit_name, op, prescale, postscale, process_set,
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
    for members, (flat, sizes, pad) in zip((u.members for u in cut), buffers):
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
