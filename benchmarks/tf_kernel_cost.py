"""What one collective costs inside a TensorFlow graph: the asynchronous kernel
(`RaytrainXAsync`, the default) against `tf.numpy_function` (the fallback,
RAYTRAIN_X_TF_ASYNC=0), on 2 ranks in the same processes, same graphs.

For each path and each case, a `tf.function` and a `tf.compat.v1` session run a fixed
number of one collective per step; the time per collective is the step's time over that
number. Cases: a 4 KB allreduce (its result is the engine's buffer: no copy out) and a
1 MB broadcast (its result is copied into TensorFlow's output by the asynchronous kernel).
Prints the slowest rank's medians and the ratio async/numpy_function; writes
results/tf_kernel_cost.json.

Run alone: .venv/bin/python benchmarks/tf_kernel_cost.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import time

from common import join_world, print_table, run_ranks, write_json

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
PER_STEP = 20  # collectives per step


def _worker(rank: int, size: int, port: int, repeats: int, queue) -> None:
    import numpy as np
    import tensorflow as tf

    import raytrain_x.tensorflow as rx

    join_world(rank, size, port)
    rx.init()
    cases = {"allreduce_4KB": lambda x: rx.allreduce(x, op=rx.Sum),
             "broadcast_1MB": lambda x: rx.broadcast(x, 0)}
    inputs = {"allreduce_4KB": np.ones(1024, np.float32),
              "broadcast_1MB": np.ones(256 * 1024, np.float32)}
    out: dict = {}
    for path, flag in (("async", "1"), ("numpy_function", "0")):
        os.environ["RAYTRAIN_X_TF_ASYNC"] = flag
        for case, op in cases.items():
            x = tf.constant(inputs[case])

            @tf.function
            def step(x=x, op=op):
                y = x
                for _ in range(PER_STEP):
                    y = op(y)
                return y

            def timed(run, key):
                run()  # trace, warm the response cache
                times = []
                for _ in range(repeats):
                    rx.barrier()
                    started = time.perf_counter()
                    run()
                    times.append((time.perf_counter() - started) / PER_STEP)
                # the slowest rank's median: a collective is as slow as that
                out[key] = float(max(rx.allgather_object(float(np.median(times)))))

            timed(step, f"{path}/{case}/function")
            with tf.Graph().as_default():
                y = tf.constant(inputs[case])
                for _ in range(PER_STEP):
                    y = op(y)
                with tf.compat.v1.Session() as session:
                    timed(lambda y=y, session=session: session.run(y),
                          f"{path}/{case}/session")
    os.environ.pop("RAYTRAIN_X_TF_ASYNC", None)
    rx.shutdown()
    if rank == 0:
        queue.put(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    medians = run_ranks(_worker, 2, args.repeats)
    rows = []
    for key in sorted(k for k in medians if k.startswith("async/")):
        _, case, mode = key.split("/")
        base = medians[f"numpy_function/{case}/{mode}"]
        rows.append({"case": case, "mode": mode, "async ms/op": medians[key] * 1e3,
                     "numpy_function ms/op": base * 1e3, "ratio": medians[key] / base})
    print_table(rows, ["case", "mode", "async ms/op", "numpy_function ms/op", "ratio"])
    write_json("tf_kernel_cost", {"per_op_s": medians, "per_step": PER_STEP,
                                  "repeats": args.repeats})


if __name__ == "__main__":
    main()
