"""How TensorFlow tensors reach the engine and come back, on CPU, one process:

  to_numpy        eager tf.Tensor -> numpy view through DLPack (what the face does)
  tensor.numpy()  TensorFlow's own conversion, for comparison (a copy)
  np.array copy   one copy of the same bytes, for scale
  to_tensor       aligned numpy result -> tf.Tensor through DLPack (what the face does)
  tf.constant     the copying alternative
  numpy_function  the cost per call of the graph path, for a tiny tensor and for the
                  tensors of a ResNet-50 (one call with every gradient), against the same
                  tf.function without it
Each conversion also reports whether the result shares the source's memory.
Writes results/tf_zero_copy.json.

Run: .venv/bin/python benchmarks/tf_zero_copy.py
"""

from __future__ import annotations

import os

from common import median_seconds, print_table, write_json

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main() -> None:
    import numpy as np
    import tensorflow as tf

    from raytrain_x.common.workloads import resnet50_parameter_shapes
    from raytrain_x.tensorflow.arrays import aligned_empty, to_numpy, to_tensor

    mb = 100
    x = tf.random.normal([mb * 2**20 // 4])
    view = to_numpy(x)
    result = aligned_empty(view.shape, view.dtype)
    result[...] = view
    back = to_tensor(result)
    rows = [
        {"what": "to_numpy (DLPack)", "ms": median_seconds(lambda: to_numpy(x), 20) * 1e3,
         "shares": view.ctypes.data == np.from_dlpack(x).ctypes.data},
        {"what": "tensor.numpy()", "ms": median_seconds(x.numpy, 5) * 1e3,
         "shares": x.numpy().ctypes.data == view.ctypes.data},
        {"what": "np.array copy", "ms": median_seconds(lambda: np.array(view), 5) * 1e3,
         "shares": False},
        {"what": "to_tensor (DLPack)", "ms": median_seconds(lambda: to_tensor(result), 20) * 1e3,
         "shares": np.from_dlpack(back).ctypes.data == result.ctypes.data},
        {"what": "tf.constant", "ms": median_seconds(lambda: tf.constant(result), 5) * 1e3,
         "shares": np.from_dlpack(tf.constant(result)).ctypes.data == result.ctypes.data},
    ]

    seen = {}

    def probe(a):
        seen["shares"] = a.ctypes.data == view.ctypes.data
        return np.zeros((), np.int32)

    tf.function(lambda t: tf.numpy_function(probe, [t], tf.int32, stateful=True))(x)
    rows.append({"what": "numpy_function input", "ms": float("nan"),
                 "shares": seen["shares"]})

    def per_call(inputs):
        plain = tf.function(lambda *t: tf.add_n([tf.reduce_sum(v) for v in t]))
        wrapped = tf.function(lambda *t: tf.numpy_function(
            lambda *a: np.zeros((), np.int32), list(t), tf.int32, stateful=True))
        return (median_seconds(lambda: plain(*inputs), 30, warmup=3),
                median_seconds(lambda: wrapped(*inputs), 30, warmup=3))

    small = [tf.ones([1024])]
    grads = [tf.ones(s) for s in resnet50_parameter_shapes()]
    for label, inputs in (("1 tensor of 4 KB", small), (f"{len(grads)} ResNet-50 tensors",
                                                         grads)):
        plain_s, wrapped_s = per_call(inputs)
        rows.append({"what": f"numpy_function call, {label}", "ms": wrapped_s * 1e3,
                     "shares": f"(a reduce_sum function: {plain_s * 1e3:.2f} ms)"})
    print_table(rows, ["what", "ms", "shares"])
    path = write_json("tf_zero_copy", {"megabytes": mb, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
