"""Whole-object helpers: variables from a root rank (eagerly, in `tf.function` and in a
`tf.compat.v1` session), and Python objects (the core's)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import tensorflow as tf

from raytrain_x.common.errors import UnsupportedOperationError
from raytrain_x.core.objects import allgather_object, broadcast_object
from raytrain_x.core.process_sets import ProcessSet, global_process_set
from raytrain_x.tensorflow.collectives import broadcast_

__all__ = ["allgather_object", "broadcast_global_variables", "broadcast_object",
           "broadcast_object_fn", "broadcast_variables", "BroadcastGlobalVariablesHook"]


def broadcast_variables(variables: Iterable[Any], root_rank: int,
                        process_set: ProcessSet = global_process_set) -> Any:
    """Assigns `root_rank`'s value to every variable (tf.Variable or Keras variable), on
    every member, in one collective. Eagerly it is done on return; in a graph it returns
    the op that does it (run it in the session, as Horovod's).

    Args:
        variables: `tf.Variable`s or Keras variables, the same list on every member.
        root_rank: the global rank whose value every member receives.
        process_set: the ranks that take part (default: every rank).
    """
    variables = list(variables)
    if not variables:
        return tf.no_op() if not tf.executing_eagerly() else None
    values = broadcast_(variables, root_rank, "broadcast_variables", process_set)
    return None if tf.executing_eagerly() else tf.group(*values)


def broadcast_global_variables(root_rank: int) -> Any:
    """The op that assigns `root_rank`'s value to every global variable of the default
    graph (TensorFlow 1 graphs; eagerly, use `broadcast_variables`).

    Args:
        root_rank: the global rank whose values every member takes.
    """
    if tf.executing_eagerly():
        raise UnsupportedOperationError(
            "broadcast_global_variables works on a tf.compat.v1 graph; eagerly call "
            "rx.broadcast_variables(model.variables, root_rank)")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """A function that broadcasts a Python object from `root_rank` (Horovod's form for
    graph code; objects never travel through the graph here, so `session` is unused).

    Args:
        root_rank: the global rank whose object every member receives.
        session: the `tf.compat.v1.Session` that runs the broadcast (graph mode only).
        name: the broadcasts' name; automatic if None.
        process_set: the ranks that take part (default: every rank).
    """
    def bcast(obj: Any) -> Any:
        return broadcast_object(obj, root_rank, name, process_set)

    return bcast


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Broadcasts every global variable from `root_rank` when a
    `tf.compat.v1.train.MonitoredTrainingSession` creates its session, so that all ranks
    start from the same weights (random or restored from a checkpoint).

    Args:
        root_rank: the global rank whose value every member receives.
        device: accepted for Horovod's signature.
    """

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.bcast_op = None

    def begin(self) -> None:
        graph = tf.compat.v1.get_default_graph()
        if self.bcast_op is None or self.bcast_op.graph is not graph:
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session: Any, coord: Any) -> None:
        session.run(self.bcast_op)
