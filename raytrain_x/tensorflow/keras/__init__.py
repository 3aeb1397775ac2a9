"""Horovod's Keras API on raytrain-x: `import raytrain_x.tensorflow.keras as rx` (for
`horovod.tensorflow.keras`; `raytrain_x.keras` is the same for `horovod.keras`).

Everything in `raytrain_x.tensorflow`, except that `allreduce`, `allgather`, `broadcast`,
`reducescatter` and `broadcast_global_variables` take and return values as Horovod's Keras
modules do; plus `DistributedOptimizer` and `PartialDistributedOptimizer` for Keras
optimizers, `load_model`,
`rx.callbacks` and `rx.elastic` (states and the callbacks that commit them in `fit`).
"""

from __future__ import annotations

import importlib

from raytrain_x.tensorflow import *  # noqa: F403 (the same names as the TensorFlow face)
from raytrain_x.tensorflow import __all__ as _tf_all
from raytrain_x.tensorflow.keras import callbacks
from raytrain_x.tensorflow.keras.optimizer import (
    DistributedOptimizer,
    PartialDistributedOptimizer,
)
from raytrain_x.tensorflow.keras.values import (
    allgather,
    allreduce,
    broadcast,
    broadcast_global_variables,
    load_model,
    reducescatter,
)

# the star import bound `elastic` to the TensorFlow face's; Keras users get the module
# that adds the Keras callbacks
elastic = importlib.import_module("raytrain_x.tensorflow.keras.elastic")

_KERAS = ["DistributedOptimizer", "PartialDistributedOptimizer", "allgather", "allreduce",
          "broadcast", "broadcast_global_variables", "callbacks", "elastic", "load_model",
          "reducescatter"]
__all__ = [*(n for n in _tf_all if n not in _KERAS), *_KERAS]
