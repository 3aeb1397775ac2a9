"""Process sets in the TensorFlow face, as Horovod's `horovod.tensorflow` runs them: on 2, 3
and 4 ranks, with disjoint sets (even and odd ranks), a set that overlaps both (ranks 0 and
1) and the global set, gradients through `DistributedGradientTape`, a grouped allreduce and
the legacy `DistributedOptimizer` eagerly, in `tf.function` and in a `tf.compat.v1`
session, each twenty times in a row. Every rank builds the same step for every set, as
Horovod's scripts do: a rank outside a set (or alone in one) keeps its own gradients. A
collective called by a rank outside its set fails at once with TensorFlow's
`InvalidArgumentError`."""

from __future__ import annotations

import pytest

from tests.workers import run_workers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tensorflow_ranks")]

ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_NUM_INTRAOP_THREADS": "1",
       "TF_NUM_INTEROP_THREADS": "2"}
REPEATS = 20


def _sets(n: int) -> dict[str, list[int]]:
    """Even and odd ranks, ranks 0 and 1 (overlapping both; at 2 ranks that is the global
    set), and every rank."""
    sets = {"even": list(range(0, n, 2)), "odd": list(range(1, n, 2)), "all": list(range(n))}
    return {**sets, "head": [0, 1]} if n > 2 else sets


def _expected_tape(ranks: list[int], r: int) -> float:
    """d(x*x)/dx at x = rank + 1, averaged over the set by its members (>1 of them)."""
    if r in ranks and len(ranks) > 1:
        return 2.0 * sum(q + 1 for q in ranks) / len(ranks)
    return 2.0 * (r + 1)


def _process_set_steps(size: int) -> dict:
    import tensorflow as tf

    import raytrain_x.tensorflow as rx

    sets = {k: rx.ProcessSet(v) for k, v in _sets(size).items() if k != "all"}
    rx.init(process_sets=list(sets.values()))
    sets["all"] = rx.global_process_set
    r = rx.rank()
    mine = {k: s for k, s in sets.items() if s.included()}
    out: dict = {}

    def tape_grads(x):
        grads = {}
        for k, s in sets.items():  # every rank, every set, in one order
            with tf.GradientTape() as g:
                g.watch(x)
                y = x * x
            grads[k] = rx.DistributedGradientTape(g, process_set=s).gradient(y, [x])[0]
        return grads

    def grouped_grads(a, b):
        grads = {}
        for k, s in mine.items():  # members only: d sum(sum-allreduce) / da = set size
            with tf.GradientTape() as g:
                g.watch([a, b])
                ys = rx.grouped_allreduce([a, 2.0 * b], op=rx.Sum, process_set=s)
                loss = tf.reduce_sum(ys[0]) + tf.reduce_sum(ys[1])
            ga, gb = g.gradient(loss, [a, b])
            grads[k] = tf.stack([ga[0], gb[0]])
        return grads

    x0, a0, b0 = tf.constant(float(r + 1)), tf.ones([3]), tf.ones([2])
    in_function = tf.function(lambda x, a, b: (tape_grads(x), grouped_grads(a, b)))
    for _ in range(REPEATS):
        for mode in ("eager", "function"):
            tape, grouped = ((tape_grads(x0), grouped_grads(a0, b0)) if mode == "eager"
                             else in_function(x0, a0, b0))
            for k, v in tape.items():
                out.setdefault(("tape", mode, k), set()).add(float(v))
            for k, v in grouped.items():
                out.setdefault(("grouped", mode, k), set()).add(tuple(v.numpy().tolist()))

    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        x = tf.constant(float(r + 1))
        tape, grouped = tape_grads(x), grouped_grads(tf.ones([3]), tf.ones([2]))
        variables, updates = {}, []
        for k, s in sets.items():  # the legacy optimizer: v += the set's mean of ranks
            v = tf.compat.v1.Variable([0.0], name=f"v_{k}")
            opt = rx.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(-1.0),
                                          process_set=s, name=f"legacy_{k}")
            updates.append(opt.minimize(tf.reduce_sum(v * float(r)), var_list=[v]))
            variables[k] = v
        sess.run(tf.compat.v1.global_variables_initializer())
        for _ in range(REPEATS):
            got_tape, got_grouped, _ = sess.run([tape, grouped, updates])
            for k, v in got_tape.items():
                out.setdefault(("tape", "session", k), set()).add(float(v))
            for k, v in got_grouped.items():
                out.setdefault(("grouped", "session", k), set()).add(tuple(v.tolist()))
        out["legacy"] = {k: float(sess.run(v)[0]) for k, v in variables.items()}

    outside = next((s for s in sets.values() if not s.included()), None)
    if outside is not None:  # fails here, before any other rank does anything
        for mode in ("eager", "session"):
            try:
                if mode == "eager":
                    rx.allreduce(tf.ones([4]), process_set=outside)
                else:
                    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
                        sess.run(rx.allreduce(tf.ones([4]), process_set=outside))
            except tf.errors.InvalidArgumentError as exc:
                out[("outside", mode)] = str(exc)
    rx.allreduce(tf.constant([0.0]), name="done")  # no rank shuts down early
    rx.shutdown()
    return out


@pytest.mark.parametrize("size", [2, 3, 4])
def test_process_set_gradients_in_every_mode_as_horovod(size):
    results = run_workers(_process_set_steps, size, size, env=ENV, work_s=30 + 10 * size)
    sets = _sets(size)
    for r, out in enumerate(results):
        for mode in ("eager", "function", "session"):
            for k, ranks in sets.items():
                # the same answer all twenty times
                assert out[("tape", mode, k)] == {_expected_tape(ranks, r)}, (r, mode, k)
                if r in ranks:
                    assert out[("grouped", mode, k)] == {(len(ranks), 2.0 * len(ranks))}
                else:
                    assert ("grouped", mode, k) not in out
        for k, ranks in sets.items():
            mean = sum(ranks) / len(ranks) if r in ranks else r
            assert out["legacy"][k] == pytest.approx(REPEATS * mean), (r, k)
        outside = [k for k, ranks in sets.items() if r not in ranks]
        for mode in ("eager", "session") if outside else ():
            assert f"rank {r} is not a member of process set" in out[("outside", mode)]
