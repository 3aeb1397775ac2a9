"""LocalSGD and DiLoCo in the TensorFlow face, between real processes with real TensorFlow:
each matches the algorithm computed by hand (in a traced custom loop, with gradient
accumulation, and in `model.fit`), a newcomer takes the anchor at an elastic sync while
survivors keep their own updates, the state travels in the optimizer's variables (commits,
durable checkpoints), and bad arguments get one clear error."""

from __future__ import annotations

import numpy as np
import pytest

from tests.expect import error_messages
from tests.workers import run_workers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tensorflow_ranks")]

ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_NUM_INTRAOP_THREADS": "1",
       "TF_NUM_INTEROP_THREADS": "2"}
H, STEPS, BATCH = 3, 8, 6  # an exchange every 3 updates; 8: two exchanges and a remainder


def _weights(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=s).astype(np.float32) * 0.5 for s in [(4, 8), (8,), (8, 2), (2,)]]


def _model(seed: int = 0):
    from tensorflow import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(2)])
    model.set_weights(_weights(seed))
    return model


def _batch(rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 * rank + step)
    return (rng.normal(size=(BATCH, 4)).astype(np.float32),
            rng.normal(size=(BATCH, 2)).astype(np.float32))


def _reducer(kind: str, sync_every: int = H):
    import raytrain_x.tensorflow.keras as rx

    if kind == "localsgd":
        return rx.LocalSGD(sync_every=sync_every)
    return rx.DiLoCo(sync_every=sync_every, outer_lr=0.7, outer_momentum=0.9)


def _sgd(accumulate: int | None = None):
    from tensorflow import keras

    return keras.optimizers.SGD(learning_rate=0.1, momentum=0.5,
                                gradient_accumulation_steps=accumulate)


def _step_fn(model, opt):
    import tensorflow as tf
    from tensorflow import keras

    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    return step


def _reference(kind: str, passes: int) -> list[list[np.ndarray]]:
    """The algorithm by hand: two models stepping on their own data with plain Keras SGD
    (accumulating `passes` batches an update), their exchange computed in numpy (DiLoCo's
    outer SGD with Nesterov momentum as torch.optim.SGD computes it)."""
    models = [_model() for _ in range(2)]
    steps = [_step_fn(m, _sgd(passes if passes > 1 else None)) for m in models]
    anchor = [w.copy() for w in _weights()]
    momentum = [np.zeros_like(w) for w in anchor]
    for step in range(STEPS * passes):
        for rank in range(2):
            steps[rank](*_batch(rank, step))
        if (step + 1) % (H * passes):
            continue
        now = [[v.numpy() for v in m.trainable_variables] for m in models]
        if kind == "localsgd":
            anchor = [(a + b) / 2 for a, b in zip(*now)]
        else:
            grads = [((a - x) + (a - y)) / 2 for a, x, y in zip(anchor, *now)]
            momentum = [0.9 * m + g for m, g in zip(momentum, grads)]
            anchor = [a - 0.7 * (g + 0.9 * m) for a, g, m in zip(anchor, grads, momentum)]
        for m in models:
            m.set_weights(anchor)
    return [[v.numpy() for v in m.trainable_variables] for m in models]


MODES = ("tf.function", "fit", "accumulate")  # accumulate: backward_passes_per_step=2


def _trained(kind: str) -> dict:
    """Each mode's training, one after the other in one world (a fresh model and optimizer
    each), and on rank 0 the hand-computed result of each."""
    import raytrain_x.tensorflow.keras as rx

    rx.init()
    rank = rx.rank()
    out = {}
    for mode in MODES:
        model = _model()
        passes = 2 if mode == "accumulate" else 1
        opt = rx.DistributedOptimizer(_sgd(), backward_passes_per_step=passes,
                                      reducer=_reducer(kind))
        if mode == "fit":
            batches = [_batch(rank, s) for s in range(STEPS)]
            model.compile(optimizer=opt, loss="mse")
            model.fit(np.concatenate([x for x, _ in batches]),
                      np.concatenate([y for _, y in batches]), batch_size=BATCH, epochs=1,
                      shuffle=False, verbose=0)
        else:
            step = _step_fn(model, opt)
            for s in range(STEPS * passes):
                step(*_batch(rank, s))
        steps = opt._rx_steps
        out[mode] = {"weights": [v.numpy() for v in model.trainable_variables],
                     "exchanges": int(steps.outer.numpy()), "inner": int(steps.inner.numpy()),
                     "expected": _reference(kind, passes)[rank] if rank == 0 else None}
    rx.shutdown()
    return out


@pytest.mark.parametrize("kind", ["localsgd", "diloco"])
def test_matches_the_algorithm_computed_by_hand(kind):
    """In a traced loop, with backward_passes_per_step=2 (sync_every counts updates) and
    in `model.fit`."""
    results = run_workers(_trained, 2, kind, env=ENV, work_s=90)
    for mode in MODES:
        r0, r1 = results[0][mode], results[1][mode]
        for got, want in zip(r0["weights"], r0["expected"]):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=mode)
        assert (r0["exchanges"], r0["inner"]) == (r1["exchanges"], r1["inner"]) == (2, 2), mode
        # two updates on each rank's own data since the last exchange: the ranks differ
        assert not all(np.array_equal(a, b) for a, b in zip(r0["weights"], r1["weights"]))


def _outside_the_set() -> dict:
    import raytrain_x.tensorflow.keras as rx

    only_rank_0 = rx.ProcessSet([0])
    rx.init(process_sets=[only_rank_0])
    rank = rx.rank()
    model = _model()
    opt = rx.DistributedOptimizer(_sgd(), reducer=_reducer("diloco"), process_set=only_rank_0)
    step = _step_fn(model, opt)
    for s in range(STEPS):
        step(*_batch(rank, s))
    out = {"exchanges": int(opt._rx_steps.outer.numpy()),
           "weights": [v.numpy() for v in model.trainable_variables]}
    alone = _model()  # the same training with DiLoCo on one rank's own pseudo-gradients
    anchor, momentum = _weights(), [np.zeros_like(w) for w in _weights()]
    plain = _step_fn(alone, _sgd())
    for s in range(STEPS):
        plain(*_batch(rank, s))
        if (s + 1) % H == 0:
            grads = [a - v.numpy() for a, v in zip(anchor, alone.trainable_variables)]
            momentum = [0.9 * m + g for m, g in zip(momentum, grads)]
            anchor = [a - 0.7 * (g + 0.9 * m) for a, g, m in zip(anchor, grads, momentum)]
            alone.set_weights(anchor)
    out["expected"] = [v.numpy() for v in alone.trainable_variables]
    rx.barrier()  # rank 1 sends nothing: it must not end the world before rank 0 is done
    rx.shutdown()
    return out


def test_a_set_of_one_and_a_rank_outside_the_set_exchange_with_themselves():
    for r in run_workers(_outside_the_set, 2, env=ENV, work_s=60):
        assert r["exchanges"] == 2
        for got, want in zip(r["weights"], r["expected"]):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def _elastic_sync() -> dict:
    import tempfile

    import raytrain_x.tensorflow.keras as rx
    from raytrain_x.tensorflow import durable

    rx.init()
    rank = rx.rank()
    model = _model(seed=3 * rank)  # the ranks start apart: the first sync gives rank 0's
    opt = rx.DistributedOptimizer(_sgd(), reducer=_reducer("diloco", sync_every=2))
    state = rx.elastic.TensorFlowKerasState(model, opt, batch=0)
    step = _step_fn(model, opt)

    def weights() -> list[np.ndarray]:
        return [v.numpy() for v in model.trainable_variables]

    state.sync()
    out = {"first": weights()}
    for s in range(3):  # an outer step at 2, then one update on each rank's own data
        step(*_batch(rank, s))
    state.commit()
    out["before"] = weights()
    state.sync()  # a new round with both survivors: each keeps its own update
    out["kept"] = weights()
    step(*_batch(rank, 3))  # not committed: a failure rolls it back, and a survivor
    state.restore()         # goes on from its own last commit
    state.sync()
    out["restored"] = weights()
    if rank == 1:  # a newcomer in rank 1's place: a fresh model and optimizer
        model = _model(seed=7)
        opt = rx.DistributedOptimizer(_sgd(), reducer=_reducer("diloco", sync_every=2))
        state = rx.elastic.TensorFlowKerasState(model, opt, batch=0)
        step = _step_fn(model, opt)
    state.sync()
    steps = opt._rx_steps
    out["after_join"] = weights()
    out["anchor"] = [a.numpy() for a in steps.anchor]
    out["outer"], out["inner"] = int(steps.outer.numpy()), int(steps.inner.numpy())
    out["momentum"] = [m.numpy() for m in steps.slots["rx_outer_momentum"]]
    step(*_batch(rank, 3))  # the next outer step: both ranks exchange together
    out["anchor_next"] = [a.numpy() for a in steps.anchor]
    state.commit()
    with tempfile.TemporaryDirectory() as folder:  # the state as durable checkpoints keep it
        tree = state._commits.committed().tree()
        durable.save(tree, folder)
        loaded = durable.load(folder)
        names = [k for k in loaded["keys"] if k.endswith(("_rx_anchor", "_rx_outer_momentum"))]
        out["durable"] = (len(names) == 8 and loaded["keys"] == tree["keys"] and all(
            np.array_equal(a, b) for a, b in zip(loaded["values"], tree["values"])))
    rx.shutdown()
    return out


def test_a_newcomer_takes_the_anchor_and_survivors_keep_their_own_updates():
    r0, r1 = run_workers(_elastic_sync, 2, env=ENV, work_s=60)
    for a, b, w in zip(r0["first"], r1["first"], _weights()):  # no anchor yet: rank 0's
        assert np.array_equal(a, b) and np.array_equal(a, w)
    for r in (r0, r1):  # a survivor's variables are its own after a sync
        for a, b, c in zip(r["before"], r["kept"], r["restored"]):
            assert np.array_equal(a, b) and np.array_equal(a, c)
    assert not all(np.array_equal(a, b) for a, b in zip(r0["kept"], r1["kept"]))
    for w, a in zip(r1["after_join"], r1["anchor"]):  # the newcomer starts from the anchor
        assert np.array_equal(w, a)
    assert all(np.array_equal(a, b) for a, b in zip(r0["after_join"], r0["kept"]))
    assert (r0["outer"], r0["inner"]) == (r1["outer"], r1["inner"]) == (1, 1)
    for a, b in zip(r0["momentum"], r1["momentum"]):  # the outer optimizer's state too
        assert np.array_equal(a, b) and np.any(a)
    for a, b in zip(r0["anchor_next"], r1["anchor_next"]):
        assert np.array_equal(a, b)
    assert not all(np.array_equal(a, b) for a, b in zip(r0["anchor_next"], r0["anchor"]))
    assert r0["durable"] and r1["durable"]  # a durable checkpoint keeps the reducer's state


def _bad_arguments() -> list[str]:
    import tensorflow as tf

    import raytrain_x.tensorflow as rx
    from raytrain_x.common.errors import ConfigError

    return error_messages(
        ConfigError,
        lambda: rx.LocalSGD(sync_every=0),
        lambda: rx.DiLoCo(sync_every=4, overlap_steps=1),
        lambda: rx.DiLoCo(sync_every=4, outer_momentum=1.0),
        lambda: rx.DistributedOptimizer(_sgd(), reducer=rx.LocalSGD(2),
                                        compression=rx.Compression.fp16),
        lambda: rx.DistributedOptimizer(_sgd(), reducer=rx.DiLoCo(2), op=rx.Sum),
        lambda: rx.DistributedOptimizer(_sgd(), reducer="diloco"),
        lambda: rx.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                        reducer=rx.LocalSGD(2)))


def test_bad_arguments_get_one_clear_error():
    errors = run_workers(_bad_arguments, 1, env=ENV, work_s=30)[0]
    assert "no error" not in errors, errors
    assert "sync_every must be an int >= 1" in errors[0]
    assert "overlap_steps must be 0 in the TensorFlow face" in errors[1]
    assert "outer_momentum must be in [0, 1)" in errors[2]
    assert "leave out compression" in errors[3]
    assert "leave out op" in errors[4]
    assert "reducer must be rx.LocalSGD(...) or rx.DiLoCo(...)" in errors[5]
    assert "takes a Keras optimizer" in errors[6]
