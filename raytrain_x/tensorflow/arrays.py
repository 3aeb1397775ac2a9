"""TensorFlow tensors in and out of the engine, without copies on CPU.

The engine works on numpy arrays for this face. A CPU `tf.Tensor` is viewed as a numpy
array through DLPack (no copy, read-only). Results go back to TensorFlow through DLPack
too (no copy), which TensorFlow accepts only for 64-byte aligned memory: its kernels check
alignment and abort the process otherwise. The face therefore allocates every buffer it
hands back with `aligned_empty`, and `to_tensor` copies only what is not aligned.

Inside `tf.function` the same numpy kernels run through `tf.numpy_function`, which passes
inputs as numpy views of the tensors and adopts aligned outputs without a copy as well.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from raytrain_x.comm.backend import writable_alias
from raytrain_x.common.errors import ConfigError, RaytrainXError
from raytrain_x.common.process import next_number
from raytrain_x.core import collectives as _core
from raytrain_x.core.process_sets import ProcessSet, registered_id
from raytrain_x.tensorflow import kernels
from raytrain_x.tensorflow.errors import as_tf_error, graph_error, original

ALIGN = 64  # bytes; what TensorFlow's CPU kernels require of a tensor's memory

# dtypes the engine reduces and moves natively
NATIVE = (tf.float16, tf.float32, tf.float64, tf.int8, tf.uint8, tf.int32, tf.int64)
# the others Horovod supports travel as a carrier: reductions in a wider dtype (cast back
# after; bool as 0/1), data-moving collectives as the bits of one the engine moves
REDUCED_AS = {tf.bfloat16: tf.float32, tf.int16: tf.int32, tf.uint16: tf.int32,
              tf.bool: tf.int32}
MOVED_AS = {tf.bfloat16: tf.float16, tf.int16: tf.float16, tf.uint16: tf.float16,
            tf.bool: tf.uint8}
SUPPORTED = (*NATIVE, *REDUCED_AS)


def leave_to_python_under_autograph() -> None:
    """Has AutoGraph call this package's functions as they are inside a traced
    `tf.function`, as it does TensorFlow's and Keras's own. Otherwise each worker's first
    trace transpiled the face's internals: 4.1 s instead of 0.2 s for a tape step on this
    machine (docs/tensorflow.md, "Tracing"). They only build ops, with no Python control
    flow on tensor values (TF1 sessions run them unconverted too)."""
    try:  # AutoGraph's module rules have no public setter
        from tensorflow.python.autograph.core import config
    except ImportError:  # another TensorFlow layout: traces are slower, nothing else
        return
    package = __name__.split(".")[0]
    if not any(isinstance(r, config.DoNotConvert) and r.matches(package)
               for r in config.CONVERSION_RULES):
        config.CONVERSION_RULES = (config.DoNotConvert(package), *config.CONVERSION_RULES)


leave_to_python_under_autograph()


def aligned_empty(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an `ALIGN` boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(tuple(shape))


def to_numpy(tensor: Any) -> np.ndarray:
    """A read-only numpy view of an eager CPU tensor (a copy only for other devices)."""
    if isinstance(tensor, tf.Variable):
        tensor = tensor.value()
    try:
        return np.from_dlpack(tensor)
    except (RuntimeError, BufferError, TypeError):  # a GPU tensor: numpy needs host memory
        return tensor.numpy()


def writable(array: np.ndarray) -> np.ndarray:
    """`array` itself when writable; else a writable alias of its memory (an eager
    tensor's, seen through DLPack). Only for buffers the face created and owns."""
    return array if array.flags.writeable else writable_alias(array)


def to_tensor(array: np.ndarray) -> tf.Tensor:
    """`array` as a tf.Tensor over the same memory when it is aligned; a copy otherwise."""
    if array.flags.c_contiguous and array.ctypes.data % ALIGN == 0 and array.size:
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.constant(array)


def check_dtype(dtype: tf.DType, what: str) -> tf.DType:
    if dtype not in SUPPORTED:
        raise ConfigError(f"{what}: dtype {dtype.name} is not supported by raytrain-x "
                          "collectives; use float16/32/64, bfloat16, int8/16/32/64, uint8/16 "
                          "or bool")
    return dtype


def as_tensor(value: Any, what: str) -> tf.Tensor:
    """A tensor from a tensor, variable, numpy array or nested list, with a clear error."""
    if isinstance(value, tf.IndexedSlices):
        raise ConfigError(f"{what} takes dense tensors; for IndexedSlices use "
                          "DistributedGradientTape or pass tf.convert_to_tensor(slices)")
    try:
        tensor = tf.convert_to_tensor(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what} needs a tensor, got {type(value).__name__}: {exc}") from None
    check_dtype(tensor.dtype, what)
    return tensor


def op_name(kind: str, name: str | None, process_set: ProcessSet) -> str:
    """The collective's name. Eagerly: numbered per call, as the core does. Inside
    `tf.function`: fixed when the function is traced (the graph's name and the collective's
    place in it), so every call of the function reuses the same names and the engine's
    response cache serves them. In a `tf.compat.v1` graph the same, with the graph's
    number in this process in place of a function's name. Unnamed ones are counted per
    process set, so that ranks in different sets still agree on each set's names."""
    if name:
        return _core.named(kind, name)  # as the torch face names it
    if tf.executing_eagerly():
        return _core.auto_name(kind, process_set)
    graph = tf.compat.v1.get_default_graph()
    label = getattr(graph, "name", None)
    if label is None:  # a tf.Graph, which has no name
        label = getattr(graph, "_raytrain_x_label", None)
        if label is None:
            label = graph._raytrain_x_label = f"graph{next_number('tf.graph')}"
    counts = getattr(graph, "_raytrain_x_collectives", None)
    if counts is None:
        counts = graph._raytrain_x_collectives = {}
    set_id = registered_id(process_set)
    count = counts[set_id] = counts.get(set_id, -1) + 1
    return f"{kind}.{label}.{count}"



class GraphKernelError(RaytrainXError):
    """What a graph kernel run through `tf.numpy_function` (where the asynchronous kernel
    cannot be built) raises for a raytrain-x error: TensorFlow reports it as an
    `UnknownError` whose text names the original (`unwrap_error`)."""


def run_kernel(kernel: Callable[..., list[np.ndarray]], inputs: Sequence[tf.Tensor],
               out_dtypes: Sequence[tf.DType], out_shapes: Sequence[Any] | None = None,
               waits: bool = True) -> list[tf.Tensor]:
    """Runs a numpy `kernel(*arrays) -> [arrays]` on `inputs`: directly when eager (its
    errors as TensorFlow's types, `errors.as_tf_error`); inside a graph as one stateful
    asynchronous op (`kernels.run_async`), which frees TensorFlow's thread while the
    kernel waits for the engine, or as a `tf.numpy_function` where that op cannot be built.
    Stateful ops keep program order inside `tf.function`. `waits` False: the kernel only
    submits to the engine and returns at once."""
    if tf.executing_eagerly():
        try:
            arrays = kernel(*[to_numpy(t) for t in inputs])
        except RaytrainXError as exc:
            raise as_tf_error(exc) from exc
        return [to_tensor(a) for a in arrays]
    if kernels.available():
        outs = kernels.run_async(kernel, inputs, out_dtypes, waits)
    else:
        def in_graph(*arrays: np.ndarray) -> list[np.ndarray]:
            try:
                return kernel(*arrays)
            except RaytrainXError as exc:
                _, text = graph_error(exc)
                raise GraphKernelError(text) from exc

        outs = tf.numpy_function(in_graph, list(inputs), list(out_dtypes), stateful=True)
        if not isinstance(outs, (list, tuple)):
            outs = [outs]
    for out, shape in zip(outs, out_shapes or [None] * len(outs)):
        if shape is not None:
            out.set_shape(shape)
    return list(outs)


def unwrap_error(exc: BaseException) -> BaseException:
    """The raytrain-x error a `tf.errors.OpError` of a graph kernel carries, else `exc`.

    Args:
        exc: an exception a session run or a `tf.function` raised.
    """
    if isinstance(exc, tf.errors.OpError):
        return original(exc) or exc
    return exc
