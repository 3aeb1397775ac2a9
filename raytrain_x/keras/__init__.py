"""`import raytrain_x.keras as hvd` for scripts written against `horovod.keras`.

Keras 3 is one library whichever way it is imported, so this is
`raytrain_x.tensorflow.keras` under the module path `horovod.keras` users expect
(with `raytrain_x.keras.callbacks` and `raytrain_x.keras.elastic`).
"""

from __future__ import annotations

import sys

from raytrain_x.tensorflow.keras import *  # noqa: F403
from raytrain_x.tensorflow.keras import __all__, callbacks, elastic  # noqa: F401

sys.modules[__name__ + ".callbacks"] = callbacks
sys.modules[__name__ + ".elastic"] = elastic
