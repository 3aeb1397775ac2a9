"""The TensorFlow/Keras face on real processes with real TensorFlow: every collective over
every dtype and odd shapes, eagerly, in tf.function and in a tf.compat.v1 graph run by a
session, on 2 and 3 ranks; gradient tapes against
single-process training; Keras fit; IndexedSlices; a mixed TF/torch job; bad input."""

from __future__ import annotations

import numpy as np
import pytest

from tests.limits import limit
from tests.workers import run_workers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tensorflow_ranks")]

DTYPES = ["float16", "float32", "float64", "bfloat16", "int8", "uint8", "int16", "uint16",
          "int32", "int64", "bool"]
SHAPES = [(), (0,), (1,), (5, 3), (1031,)]  # scalar, empty, one element, 2-D, odd length
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_NUM_INTRAOP_THREADS": "1",
       "TF_NUM_INTEROP_THREADS": "2"}


def _base(shape: tuple, rank: int) -> np.ndarray:
    n = int(np.prod(shape, dtype=np.int64))
    return (np.arange(n) % 5 + rank + 1).reshape(shape).astype(np.float64)


def _op_matrix(dtypes: list[str]) -> dict:
    import tensorflow as tf

    import raytrain_x.tensorflow as rx

    rx.init()
    r, n = rx.rank(), rx.size()
    out: dict = {}

    def run_all(dtype: str, shape: tuple, x, rows, a2a, rs) -> dict:
        res = {"sum": rx.allreduce(x, op=rx.Sum), "min": rx.allreduce(x, op=rx.Min),
               "max": rx.allreduce(x, op=rx.Max),
               "grouped": rx.grouped_allreduce([x, x] if dtype == "bool" else [x, x * 2],
                                               op=rx.Sum),
               "gather": rx.allgather(rows), "bcast": rx.broadcast(x, n - 1),
               "alltoall": rx.alltoall(a2a)}
        if dtype != "bool":
            res["rscatter"] = rx.reducescatter(rs, op=rx.Sum)
            res["scaled"] = rx.allreduce(x, op=rx.Sum, prescale_factor=3.0,
                                         postscale_factor=2.0)
        if dtype.startswith(("float", "bfloat")):
            res["avg"] = rx.allreduce(x)
            res["halved"] = rx.allreduce(x, op=rx.Sum, prescale_factor=0.5)
        return res

    def inputs(tf_dtype, shape):
        x = tf.cast(_base(shape, r) % (2 if tf_dtype == tf.bool else 1000), tf_dtype)
        rows = tf.cast(tf.fill([r + 1, *shape[1:]], r), tf_dtype) if shape else \
            tf.cast(tf.constant(r), tf_dtype)
        a2a = tf.cast(tf.reshape(tf.range(2 * n * 3) + 100 * r, [2 * n, 3]), tf_dtype)
        rs = tf.cast(tf.fill([2 * n + 1, 2], r + 1), tf_dtype)
        return x, rows, a2a, rs

    def record(mode, dtype, shape, op, values):
        out[(mode, op, dtype, shape)] = [
            (str(v.dtype), tuple(v.shape), np.asarray(v, dtype=np.float64).tolist())
            for v in values]

    for dtype in dtypes:
        tf_dtype = getattr(tf, dtype)
        args = [inputs(tf_dtype, shape) for shape in SHAPES]
        # one tf.function per dtype, every shape in it (a trace per shape took a quarter
        # of the test)
        traced = tf.function(lambda per_shape, d=dtype: [run_all(d, s, *a) for s, a
                                                         in zip(SHAPES, per_shape)])(args)
        for shape, shape_args, graph in zip(SHAPES, args, traced):
            eager = run_all(dtype, shape, *shape_args)
            for mode, res in (("eager", eager), ("function", graph)):
                for op, value in res.items():
                    values = value if isinstance(value, list) else [value]
                    record(mode, dtype, shape, op,
                           [tf.cast(v, tf.float64).numpy() if dtype == "bfloat16"
                            else v.numpy() for v in values])
            # a TensorFlow 1 graph run by a session, one collective per run
            with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
                res = run_all(dtype, shape, *inputs(tf_dtype, shape))
                for op, value in res.items():
                    values = value if isinstance(value, list) else [value]
                    fetched = sess.run([tf.cast(v, tf.float64) if dtype == "bfloat16" else v
                                        for v in values])
                    record("session", dtype, shape, op, fetched)
    _, received = rx.alltoall(tf.range(n + 1) + 10 * r, splits=[2] + [1] * (n - 1))
    out["splits"] = received.numpy().tolist()
    # no rank sending any rows (the shared-memory route once failed on an empty block)
    out["empty"] = [rx.allgather(tf.zeros(s, tf.float32)).shape.as_list()
                    for s in [(0,), (0, 3)]]
    rx.shutdown()
    return out


# every dtype on 2 ranks; on 3 (odd splits, a middle rank) one of each family, since what
# depends on the dtype does not depend on the number of ranks
@pytest.mark.parametrize("size, dtypes", [(2, DTYPES),
                                          (3, ["float16", "bfloat16", "uint16", "int64",
                                               "bool"])],
                         ids=["2", "3"])
def test_every_collective_over_dtypes_and_odd_shapes_eager_function_and_session(size, dtypes):
    results = run_workers(_op_matrix, size, dtypes, env=ENV, work_s=60)
    for r, out in enumerate(results):
        assert out.pop("splits") == [2 if r == 0 else 1] * size
        assert out.pop("empty") == [[0], [0, 3]]
        for (mode, op, dtype, shape), values in out.items():
            where = f"rank {r} {mode} {op} {dtype} {shape}"
            xs = [_base(shape, q) % (2 if dtype == "bool" else 1000) for q in range(size)]
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
            if dtype == "bool":  # Sum and Max: logical or, Min: logical and
                expect = [np.logical_and.reduce([x != 0 for x in xs])] if op == "min" else \
                    [np.logical_or.reduce([x != 0 for x in xs])] * len(expect) \
                    if op in ("sum", "max", "grouped") else [e != 0 for e in expect]
                expect = [np.asarray(e, dtype=np.float64) for e in expect]
            assert len(values) == len(expect), where
            for (got_dtype, got_shape, got), want in zip(values, expect):
                assert got_dtype in (dtype, "float64" if dtype == "bfloat16" else dtype), where
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
    results = run_workers(_tape_training, 2, env=ENV, work_s=45)
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
    results = run_workers(_keras_digits, 2, env=ENV, work_s=60)
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
    # Horovod's test_sparse_as_dense_with_grad_aggregation, on Keras 3: an embedding's
    # sparse gradients densified and accumulated over 2 passes; 3 steps leave 1 pass
    import keras

    import raytrain_x.tensorflow.keras as hvd

    opt = hvd.DistributedOptimizer(keras.optimizers.RMSprop(0.0001), sparse_as_dense=True,
                                   backward_passes_per_step=2)
    model = keras.models.Sequential([keras.layers.Embedding(1000, 64)])
    model.compile(loss=keras.losses.mean_squared_error, optimizer=opt)
    model.build((None, 10))
    hvd.broadcast_variables(model.variables, root_rank=0)
    rng = np.random.default_rng(r)
    x, y = rng.integers(1000, size=(32, 10)), rng.random((32, 10, 64))
    for _ in range(3):
        model.train_on_batch(x, y)
    weights = hvd.allgather_object(model.get_weights()[0].sum().item(), name="emb")
    out["aggregation"] = (int(opt._agg_helper.counter.numpy()), weights[0] == weights[1])
    rx.shutdown()
    return out


def test_indexed_slices_gradients_allgathered_or_densified():
    """Also Keras 3's accumulation with densified sparse gradients, as Horovod tests it
    (its `opt._agg_helper.counter` was missing)."""
    results = run_workers(_sparse, 2, env=ENV, work_s=30)
    expect = np.zeros((10, 4))
    expect[[1, 3]] += 1.0 / 2  # rank 0's rows, weight 1, averaged over 2 ranks
    expect[[3, 7]] += 2.0 / 2  # rank 1's rows, weight 2
    for out in results:
        assert out[False][0] == "IndexedSlices" and out[True][0] != "IndexedSlices"
        np.testing.assert_allclose(out[False][1], expect)
        np.testing.assert_allclose(out[True][1], expect)
        assert out["aggregation"] == (1, True)  # one pass left over; the ranks agree


def _mixed_frameworks() -> str:
    import raytrain_x.core as core
    from raytrain_x.common.errors import TensorMismatchError

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
    except TensorMismatchError as exc:  # the TensorFlow rank's is TensorFlow's type too
        return f"TensorMismatchError: {exc}"
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return f"{type(exc).__name__}: {exc}"
    finally:
        core.shutdown()
    return "no error"


def test_a_tensorflow_rank_and_a_torch_rank_get_a_clear_mismatch_error():
    results = run_workers(_mixed_frameworks, 2, env=ENV, work_s=30)
    for text in results:
        assert text.startswith("TensorMismatchError"), text
        assert "from tensorflow" in text and "from torch" in text
        assert "same framework" in text


def _bad_input() -> dict:
    import tensorflow as tf

    import raytrain_x.tensorflow as rx
    from raytrain_x.common.errors import ConfigError

    rx.init()
    errors = {}
    for label, call in [
        ("string", lambda: rx.allreduce(tf.constant(["a"]))),
        ("object", lambda: rx.allreduce(object())),
        ("splits", lambda: rx.alltoall(tf.ones([3]), splits=[1, 1, 1])),
        ("scatter0d", lambda: rx.reducescatter(tf.ones([]))),
        ("intscale", lambda: rx.allreduce(tf.fill([2], 3), op=rx.Sum, prescale_factor=0.5,
                                          postscale_factor=1.5).numpy().tolist()),
        ("tape", lambda: rx.DistributedGradientTape("not a tape")),
    ]:
        try:
            errors[label] = f"no error: {call()}"
        except Exception as exc:  # noqa: BLE001 - the error is the result
            kinds = [k.__name__ for k in (ConfigError, tf.errors.InvalidArgumentError)
                     if isinstance(exc, k)]
            errors[label] = f"{'+'.join(kinds)} {type(exc).__name__}: {exc}"

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
    for errors in run_workers(_bad_input, 2, env=ENV, work_s=30):
        # raytrain-x's ConfigError, and TensorFlow's InvalidArgumentError as in Horovod
        both = "ConfigError+InvalidArgumentError "
        assert errors["string"].startswith(both) and "float16/32/64" in errors["string"]
        assert errors["object"].startswith(both)
        assert errors["splits"].startswith(both) and "2 non-negative" in errors["splits"]
        assert errors["scatter0d"].startswith(both)
        # integers scale in float64 and cast back toward zero, as in Horovod: 3 * 0.5 -> 1,
        # summed over 2 ranks -> 2, times 1.5 -> 3
        assert errors["intscale"] == "no error: [3, 3]", errors["intscale"]
        assert errors["tape"].startswith("ConfigError")
        assert errors["graph"].startswith("TensorMismatchError"), errors["graph"]


def _tape_with_autotune(log: str, timeline: str) -> dict:
    import os
    import time

    import tensorflow as tf

    import raytrain_x.tensorflow as rx
    from raytrain_x.common.autotune_config import AutotuneConfig, SearchRules
    from raytrain_x.core import runtime

    os.environ["RAYTRAIN_X_TIMELINE"] = timeline if os.environ["RAYTRAIN_X_RANK"] == "0" \
        else ""
    rx.init(autotune=AutotuneConfig(log_file=log, warmup_samples=1, steps_per_sample=3,
                                    bayes_opt_max_samples=5,
                                    rules=SearchRules(convergence_patience=0)))
    # 4 MB each: one unit per variable (gradient_layout.UNIT_BYTES): units for the engine
    # to fuse
    variables = [tf.Variable(tf.ones([1024, 1024])) for _ in range(6)] + \
        [tf.Variable(tf.ones([64])) for _ in range(6)]

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v) for v in variables])
        grads = rx.DistributedGradientTape(tape).gradient(loss, variables)
        return grads[0][0, 0], grads[-1][0]

    deadline, steps, seen = time.monotonic() + 150, 0, set()
    while time.monotonic() < deadline:
        steps += 1
        first, last = step()
        assert float(first) == 1.0 and float(last) == 1.0  # the average of ones
        seen.add(rx.knobs().fusion_threshold_bytes)
        sampler = runtime.autotune_sampler()
        done = tf.constant(1.0 if sampler is None or sampler.finished else 0.0)
        if steps % 4 == 0 and float(rx.allreduce(done, op=rx.Min, name="done")) == 1.0:
            break
    out = {"knobs": rx.knobs().to_dict(), "thresholds": sorted(seen)}
    rx.shutdown()
    return out


def test_autotune_and_the_timeline_drive_tensorflow_workers(tmp_path):
    import csv

    log, timeline = tmp_path / "tune.csv", tmp_path / "timeline.json"
    results = run_workers(_tape_with_autotune, 2, str(log), str(timeline), env=ENV,
                          work_s=60)
    assert results[0]["knobs"] == results[1]["knobs"]
    rows = list(csv.DictReader(log.open()))
    assert [r["kind"] for r in rows][-2:] == ["best", "after"]
    scored = [r for r in rows if r["kind"] in ("sample", "confirm", "best")]
    # the engine fuses the tape's chunks up to the fusion threshold: autotune searches it
    assert {r["searched"] for r in scored} == {"fusion_threshold_bytes+cycle_time_ms"}
    assert len({int(r["fusion_threshold_bytes"]) for r in scored}) > 1
    assert len(results[0]["thresholds"]) > 1
    assert "DistributedGradientTape" in timeline.read_text()  # rank 0's timeline


def _elastic_keras(steps: int, progress: str) -> dict:
    """Written as Horovod's elastic Keras example, with the import swapped: accumulation over
    2 passes with averaging, its metric-average and warmup callbacks, the elastic ones."""
    import os
    import time

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    from tensorflow import keras

    import raytrain_x.tensorflow.keras as hvd

    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01), backward_passes_per_step=2,
                                   average_aggregated_gradients=True)
    model.compile(optimizer=opt, loss="mse")
    state = hvd.elastic.TensorFlowKerasState(model, epoch=0, batch=0, done=[], sizes=[])

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            state.done.append(state.epoch * steps + state.batch - 1)
            state.sizes.append(hvd.size())
            time.sleep(0.1)
            if hvd.rank() == 0:
                with open(progress, "w") as f:
                    f.write(f"{len(state.done)} {hvd.size()}")

    callbacks = [hvd.callbacks.MetricAverageCallback(),
                 hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.01, warmup_epochs=1),
                 hvd.elastic.UpdateBatchStateCallback(state), Record(),
                 hvd.elastic.CommitStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state)]
    x, y = np.ones((steps, 4), np.float32), np.ones((steps, 1), np.float32)

    @hvd.elastic.run
    def train(state):
        while state.epoch < 2:
            model.fit(x[state.batch:], y[state.batch:], batch_size=1, epochs=1, verbose=0,
                      shuffle=False, callbacks=callbacks)
        return {"done": list(state.done), "sizes": list(state.sizes), "rank": hvd.rank(),
                "weights": [w.numpy() for w in model.weights]}

    return train(state)


def test_elastic_keras_survives_a_killed_worker(elastic_nodes, tmp_path):
    import threading
    import time

    import ray

    from raytrain_x.ray import RayExecutor
    from tests.conftest import ELASTIC_RESOURCE

    steps = 20  # per epoch; 2 epochs
    elastic_nodes(3)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=10), min_workers=2,
                           max_workers=3, cpus_per_worker=1,
                           resources_per_worker={ELASTIC_RESOURCE: 1})
    executor.start(extra_env_vars=ENV)
    progress = tmp_path / "progress"
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["results"] = executor.run(_elastic_keras, args=(steps, str(progress)))
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + limit(45)
        while True:  # 8 committed steps on 3 workers, then kill the youngest
            assert thread.is_alive(), outcome
            assert time.monotonic() < deadline, \
                f"gave up after {limit(45):.0f}s waiting for 8 committed steps on 3 workers"
            try:
                done, size = map(int, progress.read_text().split())
            except (OSError, ValueError):
                done, size = 0, 0
            if done >= 8 and size == 3:
                break
            time.sleep(0.1)
        youngest = max(executor.last_elastic_job.members.values(), key=lambda m: m.age)
        ray.kill(youngest.actor, no_restart=True)
        thread.join(240)
        assert not thread.is_alive(), "the elastic Keras job did not finish"
    finally:
        executor.shutdown()
    assert "error" not in outcome, outcome.get("error")
    results = outcome["results"]
    assert len(results) == 2  # the survivors finished
    for r in results:
        assert r["done"] == list(range(2 * steps))  # no committed step lost or repeated
        assert 3 in r["sizes"] and r["sizes"][-1] == 2
    for mine, theirs in zip(results[0]["weights"], results[1]["weights"]):
        np.testing.assert_array_equal(mine, theirs)


def test_tensorflow_examples_through_the_cli_and_the_executor(ray_cluster):
    import os
    import re
    import sys
    from pathlib import Path

    from tests import limits
    from tests.conftest import REPO

    env = {**os.environ, "RAY_AUTH_MODE": "disabled", **ENV}
    bin_dir = Path(sys.executable).parent
    # a TensorFlow script through `raytrain-x run` (the tape example), and Keras' fit
    # through RayExecutor (the Keras example): each launch path once, about 20 s each
    tape = limits.run([str(bin_dir / "raytrain-x"), "run", "-np", "2", "--address",
                       ray_cluster, "python", "examples/tensorflow_tape_digits.py",
                       "--epochs", "12"],
                      75, "the GradientTape example through raytrain-x run", cwd=REPO, env=env)
    assert tape.returncode == 0, tape.stderr[-3000:]
    match = re.search(r"\[0\]<stdout>:test accuracy ([0-9.]+) on 2 workers", tape.stdout)
    assert match and float(match.group(1)) >= 0.95, tape.stdout[-3000:]
    driver = limits.run([sys.executable, "examples/keras_digits.py", "--executor",
                         "--address", ray_cluster, "--epochs", "12"],
                        75, "the Keras example through RayExecutor", cwd=REPO, env=env)
    assert driver.returncode == 0, driver.stderr[-3000:]
    match = re.search(r"RayExecutor: test accuracy ([0-9.]+) on 2 workers", driver.stdout)
    assert match and float(match.group(1)) >= 0.95, driver.stdout[-3000:]


def _lr_callbacks() -> dict:
    import numpy as np
    from tensorflow import keras

    import raytrain_x.tensorflow.keras as rx

    rx.init()
    seen: dict = {"schedule": [], "warmup": []}

    class Record(keras.callbacks.Callback):
        def __init__(self, key):
            super().__init__()
            self.key = key

        def on_train_batch_begin(self, batch, logs=None):
            seen[self.key].append(float(self.model.optimizer.learning_rate.numpy()))

    x, y = np.ones((8, 2), np.float32), np.ones((8, 1), np.float32)
    for key, callback in (
            ("schedule", rx.callbacks.LearningRateScheduleCallback(
                0.1, lambda epoch: 0.5 ** epoch, start_epoch=1, end_epoch=3)),
            ("warmup", rx.callbacks.LearningRateWarmupCallback(0.4, warmup_epochs=2))):
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer=rx.DistributedOptimizer(keras.optimizers.SGD(0.3)),
                      loss="mse")
        model.fit(x, y, batch_size=4, epochs=4, verbose=0, callbacks=[callback, Record(key)])
        seen[key].append(float(model.optimizer.learning_rate.numpy()))
    rx.shutdown()
    return seen


def test_learning_rate_schedule_and_warmup_callbacks():
    for seen in run_workers(_lr_callbacks, 2, env=ENV, work_s=30):
        # 2 batches per epoch; the schedule acts in epochs 1 and 2 only (staircase)
        assert seen["schedule"] == pytest.approx([0.3, 0.3, 0.05, 0.05, 0.025, 0.025, 0.025,
                                                  0.025, 0.025], rel=1e-6)
        # Horovod's warmup on 2 workers: initial_lr / 2 * (epoch * 1 / 2 + 1), per batch
        # (epoch counts fractions of batches), then initial_lr from the end of warmup on
        warm = [0.4 / 2 * ((e + b / 2) / 2 + 1) for e in range(2) for b in range(2)]
        assert seen["warmup"] == pytest.approx([*warm, 0.4, 0.4, 0.4, 0.4, 0.4], rel=1e-6)


def _serial_graph_warnings(threads: int) -> int:
    """Builds two optimizers after TensorFlow's inter-op threads are set to `threads` (0:
    its default); how often the serial-graph warning was logged."""
    import logging

    import keras
    import tensorflow as tf

    import raytrain_x.tensorflow.keras as rx

    tf.config.threading.set_inter_op_parallelism_threads(threads)
    said = []

    class Count(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    logging.getLogger("raytrain_x.tensorflow").addHandler(Count())
    rx.DistributedOptimizer(keras.optimizers.SGD(0.1))
    rx.DistributedOptimizer(keras.optimizers.SGD(0.1))
    return sum("inter-op parallelism is 1" in m for m in said)


def test_one_inter_op_thread_without_the_kernels_is_warned_of_once():
    """With one inter-op thread and without raytrain-x's kernels (`RAYTRAIN_X_TF_ASYNC=0`
    here, no compiler elsewhere) TensorFlow runs all of backward before the reductions
    (docs/tensorflow.md): the optimizer says so, once. With the kernels, or TensorFlow's
    default threads, there is nothing to warn of. Each case is a fresh process, TensorFlow
    not yet started."""
    said = {}
    for threads, built in ((1, "0"), (1, "1"), (0, "0")):
        (said[threads, built],) = run_workers(_serial_graph_warnings, 1, threads,
                                              env={**ENV, "RAYTRAIN_X_TF_ASYNC": built},
                                              work_s=10)
    assert said == {(1, "0"): 1, (1, "1"): 0, (0, "0"): 0}
