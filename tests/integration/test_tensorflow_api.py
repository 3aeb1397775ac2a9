"""Horovod's TensorFlow and Keras API, whole, on real processes with real TensorFlow:
gradients through every collective (eagerly, in tf.function and in a session), Horovod's
rules checked against their closed forms; SyncBatchNormalization against BatchNormalization
on the combined batch; backward_passes_per_step against plain accumulation; groups; a
TensorFlow 1 training loop with MonitoredTrainingSession; and each added name and argument."""

from __future__ import annotations

import numpy as np
import pytest

from tests.workers import run_workers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tensorflow_ranks")]

ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_NUM_INTRAOP_THREADS": "1",
       "TF_NUM_INTEROP_THREADS": "2"}
W = np.array([1.0, 2.0, 3.0])


# ----------------------------------------------------------------------------- gradients
def _gradients() -> dict:
    """d loss / d w for loss = sum(m * collective(w * (rank + 1))), per collective and mode."""
    import tensorflow as tf

    import raytrain_x.tensorflow as rx

    rx.init()
    r, n = rx.rank(), rx.size()

    def m_like(t):
        return tf.reshape(tf.range(1, tf.size(t) + 1, dtype=t.dtype), tf.shape(t))

    def losses(w) -> dict:
        x = w * (r + 1)
        rows = tf.reshape(tf.tile(x, [n]), [n, 3])
        mine = tf.reshape(tf.range(1.0, 4.0, dtype=w.dtype) + r, [1, 3])
        out = {
            "allreduce_sum": rx.allreduce(x, op=rx.Sum),
            "allreduce_avg": rx.allreduce(x),
            "grouped_allreduce": rx.grouped_allreduce([x, 2 * x], op=rx.Sum),
            "allgather": rx.allgather(x),
            "grouped_allgather": rx.grouped_allgather([x, x[:2]]),
            "broadcast": rx.broadcast(x, 0),
            "alltoall": rx.alltoall(rows),
            "reducescatter_sum": rx.reducescatter(rows, op=rx.Sum),
            "reducescatter_avg": rx.reducescatter(rows, op=rx.Average),
            "grouped_reducescatter": rx.grouped_reducescatter([rows, rows], op=rx.Sum),
        }
        result = {}
        for k, v in out.items():
            parts = v if isinstance(v, list) else [v]
            weights = [mine if k.startswith(("reducescatter", "grouped_reducescatter"))
                       else m_like(p) for p in parts]
            result[k] = tf.add_n([tf.reduce_sum(p * q) for p, q in zip(parts, weights)])
        return result

    grads: dict = {}
    w = tf.Variable(W)
    with tf.GradientTape(persistent=True) as tape:
        eager = losses(w)
    for k, loss in eager.items():
        grads[("eager", k)] = tape.gradient(loss, w).numpy().tolist()

    @tf.function
    def in_function():
        with tf.GradientTape(persistent=True) as t:
            ls = losses(w)
        return {k: t.gradient(v, w) for k, v in ls.items()}

    for k, g in in_function().items():
        grads[("function", k)] = g.numpy().tolist()

    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        wc = tf.constant(W)
        for k, loss in losses(wc).items():  # one collective's gradient per run
            grads[("session", k)] = sess.run(tf.compat.v1.gradients(loss, wc)[0]).tolist()
    rx.shutdown()
    return grads


def _expected(kind: str, r: int, n: int) -> np.ndarray:
    """Horovod's gradient rules in closed form for the losses of `_gradients`."""
    m3 = np.arange(1.0, 4.0)
    scale = r + 1
    if kind == "allreduce_sum":
        return n * m3 * scale
    if kind == "allreduce_avg":
        return m3 * scale
    if kind == "grouped_allreduce":
        return 3 * n * m3 * scale  # x and 2x, each weighted by [1, 2, 3]
    if kind == "allgather":
        return np.arange(1.0, 3 * n + 1)[3 * r:3 * r + 3] * scale
    if kind == "grouped_allgather":
        first = np.arange(1.0, 3 * n + 1)[3 * r:3 * r + 3]
        second = np.arange(1.0, 2 * n + 1)[2 * r:2 * r + 2]
        return (first + np.append(second, 0.0)) * scale
    if kind == "broadcast":
        return m3 * scale if r == 0 else np.zeros(3)
    if kind == "alltoall":  # row r of the upstream comes back from every member
        return n * np.arange(1.0, 3 * n + 1).reshape(n, 3)[r] * scale
    every = sum(m3 + q for q in range(n))  # each member's upstream, gathered
    if kind == "reducescatter_sum":
        return n * every * scale
    if kind == "reducescatter_avg":
        return every * scale
    if kind == "grouped_reducescatter":
        return 2 * n * every * scale
    raise AssertionError(kind)


@pytest.mark.parametrize("size", [2, 3])
def test_gradients_through_every_collective_in_every_mode_follow_horovods_rules(size):
    results = run_workers(_gradients, size, env=ENV, work_s=40)
    for r, grads in enumerate(results):
        assert len(grads) == 30
        for (mode, kind), got in grads.items():
            np.testing.assert_allclose(got, _expected(kind, r, size), rtol=1e-6,
                                       err_msg=f"rank {r} {mode} {kind}")


# ----------------------------------------------------------------------------- training
def _training() -> dict:
    import tensorflow as tf
    from tensorflow import keras

    import raytrain_x.tensorflow as rx
    import raytrain_x.tensorflow.keras as rxk

    rx.init()
    r, n = rx.rank(), rx.size()
    out: dict = {}

    def data(rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(100 * rank + step)
        return rng.normal(size=(4, 3)).astype(np.float32), \
            rng.normal(size=(4, 1)).astype(np.float32)

    def grad_of(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return 2 * x.T @ (x @ w - y) / len(x)  # d mean((xw - y)^2) / dw

    # --- SyncBatchNormalization against BatchNormalization on the combined batch
    xs = [np.random.default_rng(7 + q).normal(q, 1.0 + q, size=(4, 3)).astype(np.float32)
          for q in range(n)]
    m = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    sync = rx.SyncBatchNormalization(momentum=0.5)
    plain = keras.layers.BatchNormalization(momentum=0.5)
    x_mine = tf.constant(xs[r])
    with tf.GradientTape() as tape:
        tape.watch(x_mine)
        y_sync = sync(x_mine, training=True)
        loss = tf.reduce_sum(y_sync * m)
    out["sbn_out"] = y_sync.numpy().tolist()
    out["sbn_grad"] = tape.gradient(loss, x_mine).numpy().tolist()
    x_all = tf.constant(np.concatenate(xs))
    with tf.GradientTape() as tape:
        tape.watch(x_all)
        y_plain = plain(x_all, training=True)
        loss = tf.reduce_sum(y_plain * np.concatenate([m] * n))
    full_grad = tape.gradient(loss, x_all).numpy()
    out["bn_out"] = y_plain.numpy()[4 * r:4 * r + 4].tolist()
    out["bn_grad"] = full_grad[4 * r:4 * r + 4].tolist()
    out["sbn_moving"] = [sync.moving_mean.numpy().tolist(), sync.moving_variance.numpy().tolist()]
    out["bn_moving"] = [plain.moving_mean.numpy().tolist(),
                        plain.moving_variance.numpy().tolist()]
    out["sbn_infer"] = sync(x_mine, training=False).numpy().tolist()
    out["bn_infer"] = plain(x_mine, training=False).numpy().tolist()

    # --- backward_passes_per_step: eagerly and in tf.function, against plain accumulation
    lr, steps = 0.1, 8
    for passes in (1, 2, 4):
        for average in (False, True):
            for mode in ("eager", "function"):
                w = keras.Variable(np.ones((3, 1), np.float32))
                opt = rxk.DistributedOptimizer(keras.optimizers.SGD(lr),
                                               backward_passes_per_step=passes,
                                               average_aggregated_gradients=average)

                def make_step(w, opt):
                    def step(x, y):
                        with tf.GradientTape() as t:
                            loss = tf.reduce_mean((tf.matmul(x, w) - y) ** 2)
                        opt.apply(t.gradient(loss, [w]), [w])
                    return step

                step = make_step(w, opt)
                run = tf.function(step) if mode == "function" else step
                for s in range(steps):
                    run(*data(r, s))
                out[("bpps", passes, average, mode)] = w.numpy().ravel().tolist()
                out[("bpps_iterations", passes, average, mode)] = int(opt.iterations.numpy())
        # the same by hand: every rank's local gradients summed (or averaged) over the
        # window, averaged over ranks, applied once per window
        wn = np.ones((3, 1))
        for average in (False, True):
            wn = np.ones((3, 1))
            for start in range(0, steps, passes):
                total = sum(grad_of(wn, *data(q, s)) for q in range(n)
                            for s in range(start, start + passes)) / n
                wn = wn - lr * (total / passes if average else total)
            out[("bpps_expected", passes, average)] = wn.ravel().tolist()

    # --- groups and num_groups: the same weights as ungrouped; the timeline shows groups
    def tape_train(**kwargs) -> list:
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                                  keras.layers.Dense(1)])
        model.set_weights([np.full(v.shape, 0.1 * (i + 1), np.float32)
                           for i, v in enumerate(model.weights)])
        opt = keras.optimizers.SGD(0.05)
        if kwargs.get("groups") == "lists":
            kwargs["groups"] = [[model.weights[0], model.weights[3]], [model.weights[1]]]
        for s in range(3):
            x, y = data(r, s)
            with tf.GradientTape() as t:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            tape = rx.DistributedGradientTape(t, **kwargs)
            opt.apply(tape.gradient(loss, model.trainable_variables),
                      model.trainable_variables)
        return [v.numpy().ravel().tolist() for v in model.weights]

    out["ungrouped"] = tape_train()
    import os
    import tempfile
    timeline = os.path.join(tempfile.mkdtemp(), "timeline.json")
    rx.start_timeline(timeline)
    out["groups_int"] = tape_train(groups=2)
    rx.stop_timeline()
    out["timeline"] = open(timeline).read() if r == 0 else ""  # rank 0 writes it
    out["groups_lists"] = tape_train(groups="lists")
    with pytest.warns(DeprecationWarning):
        out["num_groups"] = tape_train(num_groups=3)

    # --- a TensorFlow 1 graph: MonitoredTrainingSession, the hook, the v1 optimizer
    with tf.Graph().as_default():
        gw = tf.compat.v1.get_variable("w", initializer=tf.constant(
            np.full((3, 1), float(r + 1), np.float32)))
        xp = tf.compat.v1.placeholder(tf.float32, [None, 3])
        yp = tf.compat.v1.placeholder(tf.float32, [None, 1])
        loss = tf.reduce_mean((tf.matmul(xp, gw) - yp) ** 2)
        opt = rx.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(lr))
        train = opt.minimize(loss)
        hooks = [rx.BroadcastGlobalVariablesHook(0)]
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
            out["v1_start"] = sess.run(gw).ravel().tolist()
            for s in range(3):
                x, y = data(r, s)
                sess.run(train, {xp: x, yp: y})
            out["v1_end"] = sess.run(gw).ravel().tolist()
    wn = np.ones((3, 1))
    for s in range(3):
        wn = wn - lr * sum(grad_of(wn, *data(q, s)) for q in range(n)) / n
    out["v1_expected"] = wn.ravel().tolist()
    # the v1 optimizer accumulating 2 passes (a plain session), averaged
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        gw = tf.compat.v1.get_variable("w", initializer=tf.ones([3, 1]))
        xp = tf.compat.v1.placeholder(tf.float32, [None, 3])
        yp = tf.compat.v1.placeholder(tf.float32, [None, 1])
        step = tf.compat.v1.train.get_or_create_global_step()
        loss = tf.reduce_mean((tf.matmul(xp, gw) - yp) ** 2)
        opt = rx.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(lr),
                                      backward_passes_per_step=2,
                                      average_aggregated_gradients=True)
        train = opt.minimize(loss, global_step=step)
        sess.run(tf.compat.v1.global_variables_initializer())
        for s in range(4):
            x, y = data(r, s)
            sess.run(train, {xp: x, yp: y})
        out["v1_bpps"] = [sess.run(gw).ravel().tolist(), int(sess.run(step))]
    wn = np.ones((3, 1))
    for start in (0, 2):
        total = sum(grad_of(wn, *data(q, s)) for q in range(n) for s in (start, start + 1))
        wn = wn - lr * total / n / 2
    out["v1_bpps_expected"] = wn.ravel().tolist()
    # the v1 optimizer with Adasum: each rank's step, then the deltas combined by Adasum
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        gw = tf.compat.v1.get_variable("w", initializer=tf.ones([3, 1]))
        xp = tf.compat.v1.placeholder(tf.float32, [None, 3])
        yp = tf.compat.v1.placeholder(tf.float32, [None, 1])
        loss = tf.reduce_mean((tf.matmul(xp, gw) - yp) ** 2)
        opt = rx.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(lr),
                                      op=rx.Adasum)
        train = opt.minimize(loss)
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(train, dict(zip((xp, yp), data(r, 0))))
        out["v1_adasum"] = sess.run(gw).ravel().tolist()
    a, b = (-lr * grad_of(np.ones((3, 1)), *data(q, 0)) for q in range(2))
    dot = float((a * b).sum())
    combined = (1 - dot / (2 * (a * a).sum())) * a + (1 - dot / (2 * (b * b).sum())) * b
    out["v1_adasum_expected"] = (1 + combined).ravel().tolist()
    rx.shutdown()
    return out


def test_sync_batch_norm_accumulation_groups_and_a_tf1_session_train_as_horovod():
    results = run_workers(_training, 2, env=ENV, work_s=60)
    for r, out in enumerate(results):
        close = dict(rtol=1e-4, atol=1e-5, err_msg=f"rank {r}")
        for key in ("out", "grad", "moving", "infer"):
            np.testing.assert_allclose(out[f"sbn_{key}"], out[f"bn_{key}"], **close)
        for passes in (1, 2, 4):
            for average in (False, True):
                want = out[("bpps_expected", passes, average)]
                for mode in ("eager", "function"):
                    np.testing.assert_allclose(out[("bpps", passes, average, mode)], want,
                                               **close)
                    # Keras 3 counts updates (its gradient accumulation); Horovod counted passes
                    assert out[("bpps_iterations", passes, average, mode)] == 8 // passes
        for grouped in ("groups_int", "groups_lists", "num_groups"):
            for got, want in zip(out[grouped], out["ungrouped"]):
                np.testing.assert_allclose(got, want, **close)
        if r == 0:
            assert "DistributedGradientTape.group0" in out["timeline"]
            assert "DistributedGradientTape.group1" in out["timeline"]
        assert out["v1_start"] == [1.0, 1.0, 1.0]  # rank 0's, broadcast by the hook
        np.testing.assert_allclose(out["v1_end"], out["v1_expected"], **close)
        np.testing.assert_allclose(out["v1_bpps"][0], out["v1_bpps_expected"], **close)
        assert out["v1_bpps"][1] == 4  # the global step counts every pass
        np.testing.assert_allclose(out["v1_adasum"], out["v1_adasum_expected"], **close)
    # the ranks agree after accumulation
    np.testing.assert_allclose(results[0][("bpps", 4, False, "function")],
                               results[1][("bpps", 4, False, "function")])


# ----------------------------------------------------------------------------- names
# every public name of horovod.tensorflow and horovod.tensorflow.keras (Horovod 0.28)
HOROVOD_TF = """init shutdown is_initialized start_timeline stop_timeline size local_size
cross_size rank local_rank cross_rank is_homogeneous rank_op local_rank_op size_op
local_size_op process_set_included_op mpi_threads_supported mpi_enabled mpi_built
gloo_enabled gloo_built nccl_built ddl_built ccl_built cuda_built rocm_built ProcessSet
global_process_set add_process_set remove_process_set Average Sum Adasum Min Max Product join
allreduce grouped_allreduce allgather grouped_allgather broadcast broadcast_ alltoall
reducescatter grouped_reducescatter broadcast_variables broadcast_global_variables
BroadcastGlobalVariablesHook allgather_object broadcast_object broadcast_object_fn
DistributedOptimizer DistributedGradientTape PartialDistributedGradientTape
SyncBatchNormalization Compression elastic HorovodInternalError HostsUpdatedInterrupt""".split()
HOROVOD_KERAS = """init shutdown is_initialized start_timeline stop_timeline size local_size
cross_size rank local_rank cross_rank mpi_threads_supported mpi_enabled mpi_built gloo_enabled
gloo_built nccl_built ddl_built ccl_built cuda_built rocm_built ProcessSet global_process_set
add_process_set remove_process_set Average Sum Compression DistributedOptimizer
broadcast_global_variables allreduce allgather broadcast reducescatter load_model callbacks
elastic""".split()
HOROVOD_KERAS_CALLBACKS = """BroadcastGlobalVariablesCallback MetricAverageCallback
LearningRateScheduleCallback LearningRateWarmupCallback BestModelCheckpoint""".split()
HOROVOD_KERAS_ELASTIC = """KerasState CommitStateCallback UpdateBatchStateCallback
UpdateEpochStateCallback run""".split()


def _names(tmp: str) -> dict:
    import os

    import tensorflow as tf
    from tensorflow import keras

    import raytrain_x.keras as hk
    import raytrain_x.tensorflow as rx
    import raytrain_x.tensorflow.keras as rxk

    rx.init(process_sets=[rx.ProcessSet([0])])
    r, n = rx.rank(), rx.size()
    out: dict = {"missing": [name for module, names in (
        (rx, HOROVOD_TF), (rxk, HOROVOD_KERAS), (hk, HOROVOD_KERAS),
        (rxk.callbacks, HOROVOD_KERAS_CALLBACKS), (hk.callbacks, HOROVOD_KERAS_CALLBACKS),
        (rxk.elastic, HOROVOD_KERAS_ELASTIC)) for name in names if not hasattr(module, name)]}
    # ops read at run time, eagerly and in a graph built before they run
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        ops = [rx.rank_op(), rx.local_rank_op(), rx.size_op(), rx.local_size_op(),
               rx.process_set_included_op(1), rx.process_set_included_op(9)]
        out["graph_ops"] = [int(v) for v in sess.run(ops)]
        v = tf.compat.v1.get_variable("v", initializer=tf.constant([float(r)]))
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(rx.broadcast_global_variables(1))
        out["global_variables"] = sess.run(v).tolist()
        joined = rx.join()  # an op: nothing happens until it runs
        out["join"] = int(sess.run(joined))
    out["eager_ops"] = [int(rx.rank_op()), int(rx.size_op()), int(rx.process_set_included_op(1))]
    # broadcast_ in place, broadcast_object_fn, the positional orders
    a, b = tf.Variable([float(r)] * 2), tf.Variable(float(r) + 10)
    got = rx.broadcast_([a, b], 1)
    out["broadcast_"] = [a.numpy().tolist(), float(b.numpy()), got[0].numpy().tolist()]
    out["object_fn"] = rx.broadcast_object_fn(root_rank=1)({"from": r})
    x = tf.constant([1.0, 2.0]) * (r + 1)
    out["positional"] = rx.allreduce(x, False, "", "", rx.Compression.fp16).numpy().tolist()
    out["scoped"] = rx.allreduce(x, op=rx.Sum, name="scoped", ignore_name_scope=True,
                                 device_dense="/cpu:0").numpy().tolist()
    out["rs_args"] = rx.reducescatter(tf.ones([2 * n, 2]), "", rx.Compression.fp16, rx.Sum,
                                      prescale_factor=2.0).numpy().tolist()

    class Scaled:  # a compressor of one's own, Horovod's protocol
        @staticmethod
        def compress(t):
            return t * 2, None

        @staticmethod
        def decompress(t, ctx):
            return t / 2

    out["custom_compression"] = rx.allreduce(x, op=rx.Sum,
                                             compression=Scaled).numpy().tolist()
    # Adasum: orthogonal vectors add up, parallel ones average
    orthogonal = rx.allreduce(tf.constant([1.0 - r, float(r)]), op=rx.Adasum)
    parallel = rx.grouped_allreduce([tf.constant([2.0, 2.0])], op=rx.Adasum)[0]
    out["adasum"] = [orthogonal.numpy().tolist(), parallel.numpy().tolist()]
    # Keras-level collectives take values
    out["k_allreduce"] = np.asarray(rxk.allreduce([1.0 * r, 2.0], "value", False)).tolist()
    out["k_allgather"] = np.asarray(hk.allgather([r])).tolist()
    out["k_broadcast"] = np.asarray(hk.broadcast(np.array([r, r]), 1)).tolist()
    out["k_reducescatter"] = np.asarray(hk.reducescatter(np.ones((2 * n, 1)), None,
                                                         hk.Sum)).tolist()
    # local sources and layers keep their gradients (divided by size unless told not to)
    dense, local = keras.layers.Dense(1), keras.layers.Dense(1)
    xin = tf.constant([[1.0 + r]])
    dense(xin), local(xin)
    for scale in (True, False):
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(dense(xin) + local(xin))
        tape = rx.PartialDistributedGradientTape(t, local_layers=local,
                                                 scale_local_gradients=scale)
        grads = tape.gradient(loss, dense.trainable_weights + local.trainable_weights)
        out[f"partial_{scale}"] = [float(tf.reduce_sum(g)) for g in grads]
    # PartialDistributedOptimizer keeps local layers' gradients; compute_gradients combines
    # the others once, and apply_gradients uses them as they are
    opt = rxk.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), op=rx.Sum,
                                          local_layers=local, scale_local_gradients=False)
    before = [float(tf.reduce_sum(w)) for w in dense.trainable_weights + local.trainable_weights]
    with tf.GradientTape() as t:
        loss = tf.reduce_sum(dense(xin) + local(xin))
    pairs = opt.compute_gradients(loss, dense.trainable_weights + local.trainable_weights, t)
    out["computed"] = [float(tf.reduce_sum(g)) for g, _ in pairs]
    opt.apply_gradients(pairs)
    after = [float(tf.reduce_sum(w)) for w in dense.trainable_weights + local.trainable_weights]
    out["applied"] = [b - a for a, b in zip(after, before)]
    # load_model gives a DistributedOptimizer with its state; BestModelCheckpoint saves
    # ones, not a random start: Adam's first step moves each weight by the learning rate,
    # so an output that starts within 0.02 of the target overshoots and epoch 1 stays best
    model = keras.Sequential([keras.Input((3,)),
                              keras.layers.Dense(1, kernel_initializer="ones")])
    model.compile(rxk.DistributedOptimizer(keras.optimizers.Adam(0.01)), "mse")
    xs, ys = np.ones((8, 3), np.float32), np.zeros((8, 1), np.float32)
    path = os.path.join(tmp, f"best{r}.keras")
    best = rxk.callbacks.BestModelCheckpoint(monitor="loss")
    best.filepath = path
    model.fit(xs, ys, epochs=2, verbose=0, callbacks=[
        rxk.callbacks.BroadcastGlobalVariablesCallback(0, device="", local_variables=[]),
        rxk.callbacks.MetricAverageCallback(device=""), best])
    loaded = rxk.load_model(path)
    out["loaded"] = [type(loaded.optimizer).__name__,
                     hasattr(loaded.optimizer, "_rx_reducer"),
                     int(loaded.optimizer.iterations.numpy())]
    loaded.fit(xs, ys, epochs=1, verbose=0)
    out["loaded_iterations"] = int(loaded.optimizer.iterations.numpy())
    rx.shutdown()
    return out


def test_every_added_name_and_argument(tmp_path):
    results = run_workers(_names, 2, str(tmp_path), env=ENV, work_s=40)
    for r, out in enumerate(results):
        assert out["missing"] == []
        assert out["graph_ops"] == [r, r, 2, 2, int(r == 0), -2]
        assert out["eager_ops"] == [r, 2, int(r == 0)]
        assert out["global_variables"] == [1.0]
        assert out["join"] in (0, 1)
        assert out["join"] == results[0]["join"]
        assert out["broadcast_"] == [[1.0, 1.0], 11.0, [1.0, 1.0]]
        assert out["object_fn"] == {"from": 1}
        assert out["positional"] == [3.0, 6.0]  # average=False: the sum of [1, 2] and [2, 4]
        assert out["scoped"] == [3.0, 6.0]
        assert out["rs_args"] == [[4.0, 4.0], [4.0, 4.0]]
        assert out["custom_compression"] == [3.0, 6.0]
        assert out["adasum"] == [[1.0, 1.0], [2.0, 2.0]]
        assert out["k_allreduce"] == [1.0, 4.0]
        assert out["k_allgather"] == [0, 1]
        assert out["k_broadcast"] == [1, 1]
        assert out["k_reducescatter"] == [[2.0], [2.0]]
        # dense: averaged; local: this rank's own, divided by size when scaled
        assert out["partial_True"][2] == pytest.approx((1.0 + r) / 2)
        assert out["partial_False"][2] == pytest.approx(1.0 + r)
        assert out["partial_True"][0] == pytest.approx(1.5)
        # kernels' gradients: dense summed over ranks (3), local this rank's own (1 + r)
        assert out["computed"][0] == pytest.approx(3.0)
        assert out["computed"][2] == pytest.approx(1.0 + r)
        assert out["applied"] == pytest.approx(out["computed"])  # SGD(1.0), no second reduce
        assert out["loaded"] == ["Adam", True, 2]
        assert out["loaded_iterations"] == 3


# ----------------------------------------------------------------------------- tracing
def _allowlisted() -> list[bool]:
    from tensorflow.python.autograph.impl import conversion

    import raytrain_x.tensorflow as rx
    import raytrain_x.tensorflow.keras as rxk
    from raytrain_x.tensorflow import chunked_reduce

    def user_step(x):  # the user's own code
        return x

    return [conversion.is_allowlisted(fn)
            for fn in (rx.allreduce, rx.grouped_allreduce, rx.allgather, rx.broadcast,
                       rx.DistributedGradientTape.gradient, rxk.DistributedOptimizer,
                       chunked_reduce.grouped_reduce, user_step)]


def test_autograph_calls_the_face_as_it_is_inside_a_traced_function():
    """AutoGraph transpiles what a traced tf.function calls unless the module is on its
    do-not-convert list, as TensorFlow's and Keras's own are: the face is, so a trace does
    not convert its internals again each time (most of a trace's time before). In a
    worker: importing TensorFlow here would give numpy a bfloat16 for the later tests."""
    [face] = run_workers(_allowlisted, 1, env=ENV, work_s=20)
    assert face == [True] * 7 + [False], face  # the user's own step is still converted
