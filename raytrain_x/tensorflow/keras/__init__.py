"""Horovod's Keras API on raytrain-x: `import raytrain_x.tensorflow.keras as rx`.

Everything in `raytrain_x.tensorflow`, plus `DistributedOptimizer` for Keras optimizers,
`rx.callbacks` and `rx.elastic` (states and the callbacks that commit them in `fit`).
"""

from __future__ import annotations

import importlib

from raytrain_x.tensorflow import *  # noqa: F403 (the same names as the TensorFlow face)
from raytrain_x.tensorflow import __all__ as _tf_all
from raytrain_x.tensorflow.keras import callbacks
from raytrain_x.tensorflow.keras.optimizer import DistributedOptimizer

# the star import bound `elastic` to the TensorFlow face's; Keras users get the module
# that adds the Keras callbacks
elastic = importlib.import_module("raytrain_x.tensorflow.keras.elastic")

__all__ = [*(n for n in _tf_all if n != "elastic"), "DistributedOptimizer", "callbacks",
           "elastic"]
