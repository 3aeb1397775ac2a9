"""How long a `tf.function` that calls the TensorFlow face takes to trace, with AutoGraph
leaving the face's own Python as it is (the default) and, in the same processes, with
AutoGraph transpiling it (the face's do-not-convert rule taken out), on 2 processes.

  step        a training step: tape, DistributedGradientTape over 8 variables, SGD update
  collectives seven collectives of one tensor (sum, min, max, grouped, allgather,
              broadcast, alltoall)
  baseline    the same step with a plain GradientTape (no communication): what a trace
              costs without the face

A trace is a fresh `tf.function`'s first call (trace, graph build, one run) minus its
second call (one run), the slower rank's. "first": the first trace of each in a fresh pair
of processes (AutoGraph converts a function once per process, so this is where the cost
lands: a worker's first step); "later": the median of --repeats traces after it. Each way
runs in --rounds fresh pairs of processes, alternating which goes first. Prints medians,
ranges and ratios; writes results/tf_trace.json.

Run alone: .venv/bin/python benchmarks/tf_trace.py [--rounds 3 --repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import join_world, print_table, run_ranks, write_json

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _trace_s(tf, make) -> float:
    """One fresh function's first call minus its second."""
    fn = tf.function(make())
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    fn()
    t2 = time.perf_counter()
    return (t1 - t0) - (t2 - t1)


def _worker(rank: int, size: int, port: int, args, queue) -> None:
    import tensorflow as tf
    from tensorflow.python.autograph.core import config

    import raytrain_x.tensorflow as rx

    if args.way == "transpiled":
        config.CONVERSION_RULES = tuple(r for r in config.CONVERSION_RULES
                                        if not r.matches("raytrain_x"))
    join_world(rank, size, port)
    rx.init()
    variables = [tf.Variable(tf.ones((64, 64)) * (i + 1)) for i in range(8)]
    x = tf.ones((1031,))

    def step(tape_wrapper):
        def make():
            def fn():
                with tf.GradientTape() as tape:
                    loss = tf.add_n([tf.reduce_sum(v * v) for v in variables])
                tape = tape_wrapper(tape) if tape_wrapper else tape
                for v, g in zip(variables, tape.gradient(loss, variables)):
                    v.assign_sub(1e-4 * g)
            return fn
        return make

    def collectives():
        def fn():
            return [rx.allreduce(x, op=rx.Sum), rx.allreduce(x, op=rx.Min),
                    rx.allreduce(x, op=rx.Max), *rx.grouped_allreduce([x, x * 2]),
                    rx.allgather(x), rx.broadcast(x, 0),
                    rx.alltoall(tf.reshape(tf.range(2 * size * 3), [2 * size, 3]))]
        return fn

    # the first trace of each in this fresh process, then the median of later ones
    cases = {"baseline": step(None), "step": step(rx.DistributedGradientTape),
             "collectives": collectives}
    first = {case: _trace_s(tf, make) for case, make in cases.items()}
    later = {case: statistics.median(_trace_s(tf, make) for _ in range(args.repeats))
             for case, make in cases.items()}
    everyone = rx.allgather_object((first, later))
    rx.shutdown()
    if rank == 0:  # the slower rank's
        queue.put({f"{case}, {kind}": max(r[i][case] for r in everyone)
                   for case in cases for i, kind in enumerate(("first", "later"))})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="fresh process pairs per way")
    parser.add_argument("--out", default=None, help="JSON path (default results/)")
    args = parser.parse_args()
    samples: dict = {}
    for i in range(args.rounds):
        for way in (("as is", "transpiled") if i % 2 == 0 else ("transpiled", "as is")):
            args.way = way
            for key, value in run_ranks(_worker, 2, args).items():
                samples.setdefault(f"{key}, {way}", []).append(value)
            print(f"round {i + 1}/{args.rounds}: {way} done", flush=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    rows = [{"trace": k, "median ms": med[k] * 1e3,
             "range ms": f"{min(v) * 1e3:.0f}-{max(v) * 1e3:.0f}"} for k, v in samples.items()]
    print_table(rows, ["trace", "median ms", "range ms"])
    ratios = {f"{case}, {kind}: transpiled / as is":
              med[f"{case}, {kind}, transpiled"] / med[f"{case}, {kind}, as is"]
              for case in ("step", "collectives") for kind in ("first", "later")}
    for name, value in ratios.items():
        print(f"{name} = {value:.2f}x")
    path = write_json("tf_trace", {"samples_s": samples, "median_s": med, "ratios": ratios},
                      args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
