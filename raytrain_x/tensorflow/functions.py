"""Whole-object helpers: variables from a root rank, and Python objects (the core's)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import tensorflow as tf

from raytrain_x.core.objects import allgather_object, broadcast_object
from raytrain_x.core.process_sets import ProcessSet, global_process_set
from raytrain_x.tensorflow.ops import broadcast

__all__ = ["allgather_object", "broadcast_object", "broadcast_variables"]


def broadcast_variables(variables: Iterable[Any], root_rank: int,
                        process_set: ProcessSet = global_process_set) -> None:
    """Assigns `root_rank`'s value to every variable (tf.Variable or Keras variable), on
    every member. Works eagerly and inside `tf.function`."""
    for i, var in enumerate(variables):
        name = getattr(var, "path", None) or getattr(var, "name", "") or str(i)
        var.assign(broadcast(tf.convert_to_tensor(var), root_rank,
                             f"broadcast_variables.{i}.{name}", process_set))
