"""The errors of the TensorFlow face: TensorFlow's own types, as Horovod's ops raise them.

A TensorFlow user catches `tf.errors.OpError`s; Horovod's ops fail with
`FailedPreconditionError` where ranks disagree (shape, dtype, root rank, process set) and
`InvalidArgumentError` for a bad argument. The face raises those, each also a
raytrain-x error (`TensorMismatchError`, `ConfigError`), so code written against either
catches it, and the message still says what to do. Inside a graph the kernel fails with
the same TensorFlow code, and its text carries a tag by which `arrays.unwrap_error` (and
elastic `run`) find the original.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, TypeVar

import tensorflow as tf

from raytrain_x.common.errors import ConfigError, RaytrainXError, TensorMismatchError
from raytrain_x.common.process import next_number
from raytrain_x.tensorflow.process import tf_process

F = TypeVar("F", bound=Callable[..., Any])


class MismatchError(tf.errors.FailedPreconditionError, TensorMismatchError):
    """Ranks disagree on a collective (shape, dtype, root rank, ...)."""

    # OpError's arguments: AutoGraph re-creates an error raised while tracing from them
    def __init__(self, node_def: Any, op: Any, message: str, *args: Any) -> None:
        super().__init__(node_def, op, message, *args)

    def __reduce__(self):  # Ray sends errors between processes
        return type(self), (None, None, self.message)


class ArgumentError(tf.errors.InvalidArgumentError, ConfigError):
    """A collective's argument is invalid on this rank."""

    def __init__(self, node_def: Any, op: Any, message: str, *args: Any) -> None:
        super().__init__(node_def, op, message, *args)

    def __reduce__(self):
        return type(self), (None, None, self.message)


class NotSupportedError(ConfigError, NotImplementedError):
    """A combination Horovod's TensorFlow ops do not support either (an op or scale
    factors on `tf.IndexedSlices`): Horovod raises `NotImplementedError`."""


def as_tf_error(exc: BaseException) -> BaseException:
    """`exc` as the TensorFlow type Horovod raises for it (itself where there is none, and
    for errors Horovod raises as Python's `NotImplementedError` or `RuntimeError`)."""
    if isinstance(exc, (tf.errors.OpError, NotImplementedError, RuntimeError)) \
            and not isinstance(exc, TensorMismatchError):
        return exc
    if isinstance(exc, TensorMismatchError):
        return MismatchError(None, None, str(exc))
    if isinstance(exc, ConfigError):
        return ArgumentError(None, None, str(exc))
    return exc


def raises_tf_errors(fn: F) -> F:
    """Has a public op raise its argument and mismatch errors as TensorFlow's types."""
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RaytrainXError as exc:
            converted = as_tf_error(exc)
            if converted is exc:
                raise
            raise converted from exc
    return wrapped  # type: ignore[return-value]


# Errors of kernels that ran inside a graph, by number (`TensorFlowProcess.errors`):
# TensorFlow passes only a code and a text out of a kernel, so the text holds the number
# and `original` finds the error.
_KEPT = 64  # older ones are dropped: nobody unwrapped them
_TAG = re.compile(r"\[raytrain-x error (\d+)\]")


def graph_error(exc: BaseException) -> tuple[int, str]:
    """The TensorFlow error code and text a graph kernel fails with for `exc`."""
    tf_exc = as_tf_error(exc)
    if isinstance(tf_exc, tf.errors.OpError):
        code = tf_exc.error_code
    elif isinstance(exc, NotImplementedError):
        code = tf.errors.UNIMPLEMENTED
    elif isinstance(exc, (ValueError, TypeError)):
        code = tf.errors.INVALID_ARGUMENT
    else:
        code = tf.errors.UNKNOWN
    text = tf_exc.message if isinstance(tf_exc, tf.errors.OpError) else str(exc)
    if not isinstance(exc, RaytrainXError):
        return code, f"{type(exc).__name__}: {text}"
    number, errors = next_number("tf.error"), tf_process().errors
    errors[number] = exc
    for old in [n for n in errors if n <= number - _KEPT]:
        del errors[old]
    return code, f"[raytrain-x error {number}] {type(exc).__name__}: {text}"


def original(exc: BaseException) -> BaseException | None:
    """The raytrain-x error behind a graph kernel's `tf.errors.OpError`, if any."""
    found = _TAG.search(str(exc))
    errors = tf_process().errors
    if found and int(found.group(1)) in errors:
        return errors.pop(int(found.group(1)))
    return None
