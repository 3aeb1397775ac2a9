"""One TensorFlow training step on ResNet-50-shaped variables, 2 processes, three ways,
with the torch face's overhead measured in the same processes for comparison.

  tf_none     tf.function step: tape gradients, SGD update, no communication
  tf_rx       the same with raytrain_x.tensorflow.DistributedGradientTape
  tf_mwms     tf.distribute.MultiWorkerMirroredStrategy (RING collectives) averaging the same
              gradients (a fresh pair of processes: the strategy owns TensorFlow's runtime)
  torch_none  the torch face's baseline: backward + step, no communication
  torch_rx    raytrain_x.torch.DistributedOptimizer
Gradients are `scale * weight` (cheap and deterministic), so the step is mostly the
gradient exchange. Overheads are step minus the no-communication step of the same face.
Prints medians and ratios; writes results/tf_step.json.

Run: .venv/bin/python benchmarks/tf_step.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import json
import os

from common import join_world, median_across_ranks, print_table, run_ranks, write_json

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _tf_variables(tf):
    from raytrain_x.common.workloads import resnet50_parameter_shapes

    rng = tf.random.Generator.from_seed(0)
    return [tf.Variable(rng.normal(s) * 0.01) for s in resnet50_parameter_shapes()]


def _tf_step(tf, variables, tape_wrapper=None):
    scale = tf.constant(1.0)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * v) for v in variables]) * scale * 0.5
        if tape_wrapper is not None:
            tape = tape_wrapper(tape)
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(1e-4 * g)

    return step


def _worker(rank: int, size: int, port: int, args, queue) -> None:
    import tensorflow as tf
    import torch

    import raytrain_x.tensorflow as rx_tf
    import raytrain_x.torch as rx_torch
    from raytrain_x.common.workloads import resnet50_parameter_shapes
    from raytrain_x.torch.workloads import shaped_model

    join_world(rank, size, port)
    rx_tf.init()
    results = {}
    variables = _tf_variables(tf)
    results["tf_none"] = median_across_ranks(_tf_step(tf, variables), args.repeats, warmup=3)
    results["tf_rx"] = median_across_ranks(
        _tf_step(tf, variables, rx_tf.DistributedGradientTape), args.repeats, warmup=3)

    model = shaped_model(resnet50_parameter_shapes())
    scale = torch.ones(())
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def torch_step(optimizer):
        optimizer.zero_grad()
        model(scale).backward()
        optimizer.step()

    results["torch_none"] = median_across_ranks(lambda: torch_step(opt), args.repeats, warmup=3)
    rx_opt = rx_torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                           named_parameters=model.named_parameters())
    results["torch_rx"] = median_across_ranks(lambda: torch_step(rx_opt), args.repeats,
                                              warmup=3)
    rx_tf.shutdown()
    if rank == 0:
        queue.put(results)


def _mwms_worker(rank: int, size: int, port: int, args, queue) -> None:
    tf_ports = [port + 10 + i for i in range(size)]
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in tf_ports]},
        "task": {"type": "worker", "index": rank}})
    import tensorflow as tf

    join_world(rank, size, port)
    try:
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(
                implementation=tf.distribute.experimental.CommunicationImplementation.RING))
        with strategy.scope():
            variables = _tf_variables(tf)
        scale = tf.constant(1.0)

        @tf.function
        def step():
            def replica_step():
                with tf.GradientTape() as tape:
                    loss = tf.add_n([tf.reduce_sum(v * v) for v in variables]) * scale * 0.5
                grads = tape.gradient(loss, variables)
                grads = tf.distribute.get_replica_context().all_reduce(
                    tf.distribute.ReduceOp.MEAN, grads)
                for v, g in zip(variables, grads):
                    v.assign_sub(1e-4 * g)
            strategy.run(replica_step)

        result = {"tf_mwms": median_across_ranks(step, args.repeats, warmup=3)}
    except Exception as exc:  # noqa: BLE001 - reported as "did not run here"
        result = {"tf_mwms_error": f"{type(exc).__name__}: {exc}"[:300]}
    if rank == 0:
        queue.put(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None, help="JSON path (default results/)")
    args = parser.parse_args()
    size = 2
    results = run_ranks(_worker, size, args)
    results.update(run_ranks(_mwms_worker, size, args))
    tf_over = results["tf_rx"] - results["tf_none"]
    torch_over = results["torch_rx"] - results["torch_none"]
    ratios = {"tf_rx/tf_none": results["tf_rx"] / results["tf_none"],
              "tf overhead / torch overhead": tf_over / torch_over if torch_over > 0 else None}
    if "tf_mwms" in results:
        ratios["tf_rx/tf_mwms"] = results["tf_rx"] / results["tf_mwms"]
    rows = [{"way": k, "ms": v * 1e3} for k, v in results.items() if isinstance(v, float)]
    print_table(rows, ["way", "ms"])
    print(f"overhead over no communication: tf {tf_over * 1e3:.1f} ms, torch "
          f"{torch_over * 1e3:.1f} ms")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}" if v is not None else f"{k}: n/a")
    if "tf_mwms_error" in results:
        print(f"MultiWorkerMirroredStrategy did not run here: {results['tf_mwms_error']}")
    path = write_json("tf_step", {"workers": size, "repeats": args.repeats,
                                  "seconds": results, "ratios": ratios,
                                  "overhead_s": {"tf": tf_over, "torch": torch_over}},
                      args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
