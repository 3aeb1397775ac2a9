"""The TensorFlow/Keras face on real processes with real TensorFlow: every collective over
dtypes and odd shapes, eagerly and in tf.function, on 2 and 3 ranks; gradient tapes against
single-process training; Keras fit; IndexedSlices; a mixed TF/torch job; bad input."""

from __future__ import annotations

import numpy as np
import pytest

from tests.workers import run_workers

pytestmark = pytest.mark.slow

DTYPES = ["float16", "float32", "float64", "bfloat16", "int32", "int64"]
SHAPES = [(), (0,), (1,), (5, 3), (1031,)]  # scalar, empty, one element, 2-D, odd length
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_NUM_INTRAOP_THREADS": "1",
       "TF_NUM_INTEROP_THREADS": "2"}


def _base(shape: tuple, rank: int) -> np.ndarray:
    n = int(np.prod(shape, dtype=np.int64))
    return (np.arange(n) % 5 + rank + 1).reshape(shape).astype(np.float64)


def _op_matrix() -> dict:
    import tensorflow as tf

    import raytrain_x.tensorflow as rx

    rx.init()
    r, n = rx.rank(), rx.size()
    out: dict = {}

    def run_all(dtype: str, shape: tuple, x, rows, a2a, rs) -> dict:
        res = {"sum": rx.allreduce(x, op=rx.Sum), "min": rx.allreduce(x, op=rx.Min),
               "max": rx.allreduce(x, op=rx.Max),
               "grouped": rx.grouped_allreduce([x, x * 2], op=rx.Sum),
               "gather": rx.allgather(rows), "bcast": rx.broadcast(x, n - 1),
               "alltoall": rx.alltoall(a2a), "rscatter": rx.reducescatter(rs, op=rx.Sum),
               "scaled": rx.allreduce(x, op=rx.Sum, prescale_factor=3.0, postscale_factor=2.0)}
        if dtype.startswith(("float", "bfloat")):
            res["avg"] = rx.allreduce(x)
            res["halved"] = rx.allreduce(x, op=rx.Sum, prescale_factor=0.5)
        return res

    for dtype in DTYPES:
        tf_dtype = getattr(tf, dtype)
        for shape in SHAPES:
            x = tf.cast(_base(shape, r), tf_dtype)
            rows = tf.cast(tf.fill([r + 1, *shape[1:]], r), tf_dtype) if shape else \
                tf.cast(tf.constant(r), tf_dtype)
            a2a = tf.cast(tf.reshape(tf.range(2 * n * 3) + 100 * r, [2 * n, 3]), tf_dtype)
            rs = tf.cast(tf.fill([2 * n + 1, 2], r + 1), tf_dtype)
            eager = run_all(dtype, shape, x, rows, a2a, rs)
            graph = tf.function(lambda *a, d=dtype, s=shape: run_all(d, s, *a))(x, rows, a2a,
                                                                              rs)
            for mode, res in (("eager", eager), ("function", graph)):
                for op, value in res.items():
                    values = value if isinstance(value, list) else [value]
                    out[(mode, op, dtype, shape)] = [
                        (v.dtype.name, tuple(v.shape), tf.cast(v, tf.float64).numpy().tolist())
                        for v in values]
    _, received = rx.alltoall(tf.range(n + 1) + 10 * r, splits=[2] + [1] * (n - 1))
    out["splits"] = received.numpy().tolist()
    rx.shutdown()
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_every_collective_over_dtypes_and_odd_shapes_eager_and_in_tf_function(size):
    results = run_workers(_op_matrix, size, env=ENV, timeout=240)
    for r, out in enumerate(results):
        assert out.pop("splits") == [2 if r == 0 else 1] * size
        for (mode, op, dtype, shape), values in out.items():
            where = f"rank {r} {mode} {op} {dtype} {shape}"
            xs = [_base(shape, q) for q in range(size)]
            if op in ("sum", "grouped", "avg", "scaled", "halved"):
                total = sum(xs)
                expect = {"sum": [total], "grouped": [total, 2 * total],
                          "avg": [total / size], "scaled": [6 * total],
                          "halved": [total / 2]}[op]
            elif op == "min":
                expect = [xs[0]]
            elif op == "max":
                expect = [xs[-1]]
            elif op == "bcast":
                expect = [xs[-1]]
            elif op == "gather":
                expect = [np.concatenate([np.full((q + 1, *shape[1:]), q) for q in range(size)])
                          if shape else np.arange(size, dtype=np.float64)]
            elif op == "alltoall":
                sent = [np.arange(2 * size * 3).reshape(2 * size, 3) + 100 * q
                        for q in range(size)]
                expect = [np.concatenate([s[2 * r:2 * r + 2] for s in sent])]
            else:  # reducescatter of (2n+1, 2) rows: rank 0 gets 3 rows, the others 2
                rows = 3 if r == 0 else 2
                expect = [np.full((rows, 2), sum(q + 1 for q in range(size)))]
            assert len(values) == len(expect), where
            for (got_dtype, got_shape, got), want in zip(values, expect):
                assert got_dtype == dtype, where
                assert got_shape == want.shape, where
                np.testing.assert_allclose(np.asarray(got, dtype=np.float64).reshape(want.shape),
                                           want, rtol=1e-2, err_msg=where)


def _tape_training() -> dict:
    import tensorflow as tf

    import raytrain_x.tensorflow as rx

    rx.init()
    r, n = rx.rank(), rx.size()
    data = np.random.default_rng(0).normal(size=(16, 6)).astype(np.float32)
    target = data @ np.arange(6, dtype=np.float32)[:, None]

    def make():
        tf.keras.utils.set_random_seed(0)
        model = tf.keras.Sequential([tf.keras.Input((6,)), tf.keras.layers.Dense(4),
                                     tf.keras.layers.Dense(1)])
        return model, tf.keras.optimizers.SGD(0.05)

    def step_fn(model, opt, distributed):
        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            if distributed:
                tape = rx.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
        return step

    model, opt = make()
    step = step_fn(model, opt, True)
    for _ in range(10):  # this rank's half of the batch
        step(data[r::n], target[r::n])
    dist_weights = [w.numpy() for w in model.trainable_variables]
    reference = None
    if r == 0:  # one process on the combined batch
        model, opt = make()
        step = step_fn(model, opt, False)
        for _ in range(10):
            step(data, target)
        reference = [w.numpy() for w in model.trainable_variables]
    rx.shutdown()
    return {"weights": dist_weights, "reference": reference}


def test_distributed_gradient_tape_equals_single_process_on_the_combined_batch():
    results = run_workers(_tape_training, 2, env=ENV, timeout=180)
    reference = results[0]["reference"]
    for out in results:
        for got, want in zip(out["weights"], reference):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _keras_digits() -> dict:
    import os
    import sys

    from tests.conftest import REPO

    sys.path.insert(0, os.path.join(REPO, "examples"))
    from keras_digits import fit

    import raytrain_x.tensorflow.keras as rx

    model, accuracy = fit(12, 32, 0.05)
    weights = rx.allgather_object([w.numpy() for w in model.weights])
    rx.shutdown()
    return {"accuracy": accuracy, "weights": weights}


def test_keras_fit_converges_on_digits_with_two_workers():
    results = run_workers(_keras_digits, 2, env=ENV, timeout=240)
    assert all(r["accuracy"] >= 0.95 for r in results), results
    for mine, theirs in zip(*results[0]["weights"]):  # the same model on both ranks
        np.testing.assert_array_equal(mine, theirs)


def _sparse() -> dict:
    import tensorflow as tf

    import raytrain_x.tensorflow as rx

    rx.init()
    r = rx.rank()
    table = tf.Variable(tf.reshape(tf.range(40, dtype=tf.float32), [10, 4]))
    ids = tf.constant([[1, 3], [3, 7]][r])
    out = {}
    for sparse_as_dense in (False, True):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.nn.embedding_lookup(table, ids) * float(r + 1))
        grad = rx.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense).gradient(
            loss, table)
        out[sparse_as_dense] = (type(grad).__name__, tf.convert_to_tensor(grad).numpy())
    rx.shutdown()
    return out


def test_indexed_slices_gradients_allgathered_or_densified():
    results = run_workers(_sparse, 2, env=ENV, timeout=120)
    expect = np.zeros((10, 4))
    expect[[1, 3]] += 1.0 / 2  # rank 0's rows, weight 1, averaged over 2 ranks
    expect[[3, 7]] += 2.0 / 2  # rank 1's rows, weight 2
    for out in results:
        assert out[False][0] == "IndexedSlices" and out[True][0] != "IndexedSlices"
        np.testing.assert_allclose(out[False][1], expect)
        np.testing.assert_allclose(out[True][1], expect)


def _mixed_frameworks() -> str:
    import raytrain_x.core as core

    core.init()
    try:
        if core.rank() == 0:
            import tensorflow as tf

            import raytrain_x.tensorflow as rx_tf

            rx_tf.allreduce(tf.ones([4]), name="shared")
        else:
            import torch

            import raytrain_x.torch as rx_torch

            rx_torch.allreduce(torch.ones(4), name="shared")
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return f"{type(exc).__name__}: {exc}"
    finally:
        core.shutdown()
    return "no error"


def test_a_tensorflow_rank_and_a_torch_rank_get_a_clear_mismatch_error():
    results = run_workers(_mixed_frameworks, 2, env=ENV, timeout=120)
    for text in results:
        assert text.startswith("TensorMismatchError"), text
        assert "from tensorflow" in text and "from torch" in text
        assert "same framework" in text


def _bad_input() -> dict:
    import tensorflow as tf

    import raytrain_x.tensorflow as rx

    rx.init()
    errors = {}
    for label, call in [
        ("string", lambda: rx.allreduce(tf.constant(["a"]))),
        ("object", lambda: rx.allreduce(object())),
        ("splits", lambda: rx.alltoall(tf.ones([3]), splits=[1, 1, 1])),
        ("scatter0d", lambda: rx.reducescatter(tf.ones([]))),
        ("intscale", lambda: rx.allreduce(tf.ones([2], tf.int32), op=rx.Sum,
                                          prescale_factor=0.5)),
        ("tape", lambda: rx.DistributedGradientTape("not a tape")),
    ]:
        try:
            call()
            errors[label] = "no error"
        except Exception as exc:  # noqa: BLE001 - the error is the result
            errors[label] = f"{type(exc).__name__}: {exc}"

    @tf.function
    def differing(x):
        return rx.allreduce(x, name="differs")

    try:  # ranks disagree on the shape inside a graph: the engine's error, unwrapped
        differing(tf.ones([rx.rank() + 1]))
        errors["graph"] = "no error"
    except tf.errors.OpError as exc:
        original = rx.unwrap_error(exc)
        errors["graph"] = f"{type(original).__name__}: {original}"
    rx.shutdown()
    return errors


def test_bad_input_gets_a_clear_error():
    for errors in run_workers(_bad_input, 2, env=ENV, timeout=120):
        assert errors["string"].startswith("ConfigError") and "float16/32/64" in \
            errors["string"]
        assert errors["object"].startswith("ConfigError")
        assert errors["splits"].startswith("ConfigError") and "2 non-negative" in \
            errors["splits"]
        assert errors["scatter0d"].startswith("ConfigError")
        assert errors["intscale"].startswith("ConfigError") and "whole" in errors["intscale"]
        assert errors["tape"].startswith("ConfigError")
        assert errors["graph"].startswith("TensorMismatchError"), errors["graph"]
