"""TensorFlow graphs that fetch several collectives at once, and the errors Horovod's
TensorFlow users catch, on real ranks.

A `tf.compat.v1` session runs independent ops in whatever order its threads pick; each
rank here even builds its graph in another order. The collectives run through the
asynchronous kernel (`raytrain_x.tensorflow.kernels`), which never waits on one of
TensorFlow's threads, so every fetch completes. Ranks that disagree get
`tf.errors.FailedPreconditionError`, a bad argument `tf.errors.InvalidArgumentError`, an
op Horovod does not support on `tf.IndexedSlices` `NotImplementedError`: in a session,
in `tf.function` and eagerly."""

from __future__ import annotations

import pytest

from tests.workers import run_workers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tensorflow_ranks")]

ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_NUM_INTRAOP_THREADS": "1"}
REPS = 20


def _collectives(rx, tf, r: int, n: int) -> list:
    """Eight independent collectives and what each must give, as (label, op, expected)."""
    import numpy as np

    x = tf.constant(np.arange(5, dtype=np.float32) + r)
    total = sum(np.arange(5, dtype=np.float32) + q for q in range(n))
    rows = tf.fill([r + 1, 3], float(r))  # a different size on every rank
    gathered = np.concatenate([np.full((q + 1, 3), float(q)) for q in range(n)])
    a2a = tf.reshape(tf.range(2 * n, dtype=tf.int32) + 100 * r, [2 * n, 1])
    received = np.concatenate([np.array([[2 * r + 100 * q], [2 * r + 1 + 100 * q]])
                               for q in range(n)])
    scatter = tf.fill([n, 2], float(r + 1))
    return [
        ("allreduce", lambda: rx.allreduce(x, op=rx.Sum, name="a"), total),
        ("average", lambda: rx.allreduce(x * 2, name="b"), 2 * total / n),
        ("allgather", lambda: rx.allgather(rows, name="c"), gathered),
        ("broadcast", lambda: rx.broadcast(x, n - 1, name="d"), np.arange(5) + n - 1),
        ("alltoall", lambda: rx.alltoall(a2a, name="e"), received),
        ("grouped", lambda: rx.grouped_allreduce([x, x * 3], op=rx.Sum, name="f")[1],
         3 * total),
        ("grouped_allgather", lambda: rx.grouped_allgather([rows, rows], name="g")[0],
         gathered),
        ("reducescatter", lambda: rx.reducescatter(scatter, op=rx.Sum, name="h"),
         np.full((1, 2), float(sum(q + 1 for q in range(n))))),
    ]


def _fetch_together(reps: int) -> dict:
    import time

    import numpy as np
    import tensorflow as tf

    import raytrain_x.tensorflow as rx
    from raytrain_x.tensorflow import kernels

    rx.init()
    r, n = rx.rank(), rx.size()
    out: dict = {"async": kernels.available()}
    for threads in (1, 2):  # even one inter-op thread: no kernel holds it while it waits
        with tf.Graph().as_default():
            built = _collectives(rx, tf, r, n)
            order = built[r % len(built):] + built[:r % len(built)]  # per-rank build order
            if r % 2:
                order.reverse()
            ops = {label: make() for label, make, _ in order}
            config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads)
            with tf.compat.v1.Session(config=config) as session:
                started = time.perf_counter()
                for _ in range(reps):
                    values = session.run(ops)
                out[f"session{threads}_s"] = time.perf_counter() - started
        out[f"session{threads}"] = all(np.allclose(values[label], expected)
                                       for label, _, expected in built)
    # tf.function and eagerly: program order, the same on every rank
    built = _collectives(rx, tf, r, n)
    traced = tf.function(lambda: {label: make() for label, make, _ in built})
    for mode, run in (("function", traced),
                      ("eager", lambda: {label: make() for label, make, _ in built})):
        for _ in range(reps):
            values = run()
        out[mode] = all(np.allclose(values[label].numpy(), expected)
                        for label, _, expected in built)
    out["mismatches"] = _mismatches(rx, tf, r, n)
    rx.shutdown()
    return out


def _mismatches(rx, tf, r: int, n: int) -> dict:
    """The error type of each bad call, in a session, in tf.function and eagerly."""
    calls = {
        "shape": lambda: rx.allreduce(tf.ones([3 + r]), name="shape"),
        "same_size_other_shape": lambda: rx.allreduce(
            tf.ones([6] if r == 0 else [2, 3]), name="layout"),
        "dtype": lambda: rx.allreduce(tf.ones([3], tf.int32 if r == 0 else tf.float32),
                                      op=rx.Sum, name="dtype"),
        "root": lambda: rx.broadcast(tf.ones([2]), r, name="root"),
        "splits": lambda: rx.alltoall(tf.ones([n + 1])),  # dim 0 not divisible by n
        "indexed_slices_min": lambda: rx.allreduce(
            tf.IndexedSlices(tf.ones([1, 3]), tf.constant([r])), op=rx.Min),
    }
    types = {"FailedPreconditionError": tf.errors.FailedPreconditionError,
             "InvalidArgumentError": tf.errors.InvalidArgumentError,
             "NotImplementedError": NotImplementedError}
    seen = {}
    for mode in ("session", "function", "eager"):
        for label, call in calls.items():
            try:
                if mode == "session":
                    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
                        session.run(call())
                elif mode == "function":
                    tf.function(call)()
                else:
                    call()
                seen[(mode, label)] = "no error"
            except Exception as exc:  # noqa: BLE001 - the type is the result
                seen[(mode, label)] = next(
                    (name for name, kind in types.items() if isinstance(exc, kind)),
                    f"{type(exc).__name__}: {exc}")
    return seen


@pytest.mark.parametrize("size", [2, 3])
def test_a_session_fetching_independent_collectives_in_any_order_completes(size):
    results = run_workers(_fetch_together, size, REPS, env=ENV, work_s=60)
    for r, out in enumerate(results):
        assert out["async"], "the asynchronous kernel was not built"
        for mode in ("session1", "session2", "function", "eager"):
            assert out[mode], f"rank {r}: wrong values in {mode}"
        errors = out["mismatches"]
        for mode in ("session", "function", "eager"):
            for label in ("shape", "same_size_other_shape", "dtype", "root"):
                assert errors[(mode, label)] == "FailedPreconditionError", \
                    (mode, label, errors[(mode, label)])
            assert errors[(mode, "splits")] == "InvalidArgumentError", errors[(mode, "splits")]
            assert errors[(mode, "indexed_slices_min")] == "NotImplementedError", \
                errors[(mode, "indexed_slices_min")]


def _chunk_reaches_engine_first(wait_s: float) -> dict:
    """A gradient unit whose tensors are done must reach the engine before the executor's
    one thread runs the next expensive op, as backward's next kernel would be. Here that op
    waits until the chunk was submitted (or `wait_s`): had the executor run it first, it
    would wait out the whole time while the chunk sat behind it."""
    import threading

    import numpy as np
    import tensorflow as tf

    import raytrain_x.tensorflow as rx
    from raytrain_x.tensorflow import chunked_reduce, kernels

    rx.init()
    r, n = rx.rank(), rx.size()
    submitted = threading.Event()
    submit = chunked_reduce._submit_unit

    def observed(*args, **kwargs):  # the real submission, noted
        submitted.set()
        return submit(*args, **kwargs)

    chunked_reduce._submit_unit = observed

    def next_kernel(_: np.ndarray) -> np.ndarray:
        return np.array(submitted.wait(wait_s))

    out = {"async": kernels.available()}
    with tf.Graph().as_default():
        # not a whole number of 64-byte rows: TensorFlow's own layout pads it first
        gradient = tf.fill([(1 << 20) + 3], float(r + 1)) * 2.0
        reduced = rx.grouped_allreduce([gradient], op=rx.Sum, name="first")[0]
        # stateful: never evaluated ahead by the graph optimizer's constant folding
        queued = tf.numpy_function(next_kernel, [gradient], tf.bool, stateful=True)
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1)
        with tf.compat.v1.Session(config=config) as session:
            values, out["queued_first"] = session.run([reduced, queued])
    out["values"] = bool(np.allclose(values, 2.0 * sum(q + 1 for q in range(n))))
    rx.shutdown()
    return out


def test_a_gradient_chunk_reaches_the_engine_before_the_next_kernel_runs():
    results = run_workers(_chunk_reaches_engine_first, 2, 20.0, env=ENV, work_s=60)
    for r, out in enumerate(results):
        assert out["async"], "the asynchronous kernel was not built"
        assert out["queued_first"], f"rank {r}: the next kernel ran before the chunk was queued"
        assert out["values"], f"rank {r}: wrong sums"
