"""The kernels that run the face's collectives inside TensorFlow graphs.

Two custom ops (csrc/async_kernel.cc), built on first use against the installed
TensorFlow and cached. `RaytrainXAsync` hands its inputs to Python and returns its
inter-op thread at once; a raytrain-x thread runs the kernel (submit to the engine, wait)
and completes the op. A session that fetches several collectives therefore never waits
with TensorFlow's threads: each rank starts all of them, in whatever order its executor
picks, and the engine negotiates one order, as with Horovod's `AsyncOpKernel`s. Errors
come back with TensorFlow's error codes (`tf.errors.FailedPreconditionError` for ranks
that disagree, `InvalidArgumentError` for a bad argument), as Horovod's ops raise them.
`RaytrainXConcat` (`concat`) lays a unit of gradients out for the engine. The executor
runs it, and a `RaytrainXAsync` that only submits, at once on the thread that produced its
last input, rather than queueing it behind backward's kernels: a unit reaches the engine
as soon as backward has produced it.

Where the ops cannot be built (no C++ compiler), kernels run through `tf.numpy_function`
as before, with a warning: collectives fetched together in one `session.run` then need a
fixed order (`tf.control_dependencies`).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from raytrain_x.common import settings
from raytrain_x.common.process import next_number
from raytrain_x.tensorflow.process import tf_process

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "async_kernel.cc"

_DISPATCH = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                             ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int),
                             ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int64))



def library_path() -> Path:
    """Where the kernel built for this TensorFlow and this source is cached."""
    key = hashlib.sha256(SOURCE.read_bytes() + tf.__version__.encode()
                         + " ".join(tf.sysconfig.get_compile_flags()).encode()).hexdigest()
    # the user's cache folder, as the XDG base directories name it
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "raytrain-x"
    return root / f"tf_async_kernel-{tf.__version__}-{key[:16]}.so"


def build(path: Path | None = None) -> Path:
    """Compiles the kernel (once per TensorFlow version; a file lock lets the workers of a
    host wait for the first one's build). Raises RuntimeError with the compiler's output."""
    path = path or library_path()
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return path
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        cmd = [os.environ.get("CXX", "c++"), "-std=c++17", "-shared", "-fPIC", "-O2",
               "-Wno-deprecated-declarations", str(SOURCE), "-o", str(tmp),
               *tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building raytrain-x's TensorFlow kernel failed ({' '.join(cmd)})"
                               f":\n{proc.stderr[-3000:]}")
        os.replace(tmp, path)
    return path


def _load() -> Any:
    """The op module, built and loaded on first use; None where it cannot be built."""
    state = tf_process()
    with state.lock:
        if state.loaded is None:
            try:
                path = build()
                ops = tf.load_op_library(str(path))
                lib = ctypes.CDLL(str(path))
                lib.raytrain_x_tf_complete.argtypes = [
                    ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                    ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int),
                    ctypes.POINTER(ctypes.c_int64)]
                lib.raytrain_x_tf_register(_dispatch_c)
                state.loaded = (ops, lib)
            except (RuntimeError, OSError, tf.errors.NotFoundError) as exc:
                log.warning("raytrain-x: %s; TensorFlow graphs run collectives through "
                            "tf.numpy_function, which needs them in one order on every rank",
                            exc)
                state.loaded = False
        return state.loaded or None


def available() -> bool:
    """Whether graphs run collectives through the asynchronous kernel."""
    return settings.TF_ASYNC.read() and _load() is not None


def run_async(kernel: Callable[..., list[np.ndarray]], inputs: Sequence[tf.Tensor],
              out_dtypes: Sequence[tf.DType], waits: bool = True) -> list[tf.Tensor]:
    """`kernel(*arrays) -> [arrays]` as one `RaytrainXAsync` op of the current graph. A
    kernel that never `waits` (it only submits to the engine) runs on TensorFlow's
    thread; the others on a raytrain-x thread."""
    ops, _ = _load()
    kernel_id = next_number("tf.kernel") + 1  # 0 is no kernel
    tf_process().kernels[kernel_id] = (kernel, [np.dtype(d.as_numpy_dtype) for d in out_dtypes],
                           not waits)
    return list(ops.raytrain_x_async(list(inputs), Tout=list(out_dtypes), kernel=kernel_id,
                                     cheap=not waits))


def concat(tensors: Sequence[tf.Tensor], row: int) -> tuple[tf.Tensor, tf.Tensor]:
    """One `RaytrainXConcat` op of the current graph: `tensors` (one dtype) flattened,
    each zero-padded to whole rows of `row` elements, back to back in a fresh buffer with
    one more row of zeros at the end; and their shapes (each its rank, then its dims) as
    one int64 vector. The executor runs it as soon as the last of them exists, so a unit
    of gradients reaches the engine while backward goes on."""
    ops, _ = _load()
    flat, shapes = ops.raytrain_x_concat(list(tensors), row=row)
    return flat, shapes


# ----------------------------------------------------------------------- the Python side


def _array(address: int, dtype: int, shape: tuple[int, ...]) -> np.ndarray:
    """A read-only numpy view of a TensorFlow input's memory (alive until the op is done)."""
    np_dtype = np.dtype(tf.dtypes.as_dtype(dtype).as_numpy_dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0 or not address:
        return np.empty(shape, np_dtype)
    buf = (ctypes.c_char * (count * np_dtype.itemsize)).from_address(address)
    array = np.frombuffer(buf, dtype=np_dtype).reshape(shape)
    array.flags.writeable = False
    return array


@_DISPATCH
def _dispatch_c(kernel_id, call, n, data, dtypes, ranks, dims) -> None:
    """`RaytrainXAsync::ComputeAsync` (a TensorFlow thread): takes the inputs and returns."""
    try:
        arrays, k = [], 0
        for i in range(n):
            shape = tuple(dims[k + d] for d in range(ranks[i]))
            k += ranks[i]
            arrays.append(_array(data[i] or 0, dtypes[i], shape))
        state = tf_process()
        kernel, out_dtypes, inline = state.kernels[kernel_id]
    except BaseException as exc:  # noqa: BLE001 - the op fails with it, not the process
        _complete(call, exc, [])
        return
    if inline:
        _run(call, kernel, out_dtypes, arrays)
    else:
        state.runners.submit(lambda: _run(call, kernel, out_dtypes, arrays))


def _run(call: int, kernel: Callable[..., list[np.ndarray]], out_dtypes: list[np.dtype],
         arrays: list[np.ndarray]) -> None:
    try:
        outs = kernel(*arrays)
        outs = [np.asarray(o, dtype=d, order="C") for o, d in zip(outs, out_dtypes)]
    except BaseException as exc:  # noqa: BLE001 - reported to the op
        _complete(call, exc, [])
        return
    _complete(call, None, outs)


def _complete(call: int, exc: BaseException | None, outs: list[np.ndarray]) -> None:
    _, lib = tf_process().loaded
    if exc is not None:
        from raytrain_x.tensorflow.errors import graph_error
        code, message = graph_error(exc)
        lib.raytrain_x_tf_complete(call, code, message.encode(errors="replace"), 0,
                                   None, None, None)
        return
    data = (ctypes.c_void_p * len(outs))(*[o.ctypes.data for o in outs])
    ranks = (ctypes.c_int * len(outs))(*[o.ndim for o in outs])
    flat = [d for o in outs for d in o.shape]
    dims = (ctypes.c_int64 * max(1, len(flat)))(*flat)
    lib.raytrain_x_tf_complete(call, 0, None, len(outs), data, ranks, dims)


def _main() -> None:
    """`python -m raytrain_x.tensorflow.kernels`: builds the kernel now (make test does)."""
    path = build()
    print(f"raytrain-x TensorFlow kernel: {path}", file=sys.stderr)


if __name__ == "__main__":
    _main()
