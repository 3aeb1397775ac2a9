"""The TensorFlow face on networks that compute: Keras `model.fit` with raytrain-x's
`DistributedOptimizer` against TensorFlow's own `MultiWorkerMirroredStrategy`.

Workloads (`raytrain_x.tensorflow.workloads`, the Keras twins of the torch benchmark's):
  resnet18   ResNet-18 on 64x64 images, SGD with momentum
  gpt        the GPT-style decoder (6 layers, width 512, sequence 128), AdamW
Ways, in the same processes (MultiWorkerMirroredStrategy is made first, as TensorFlow
requires; the other models are built outside its scope), interleaved round by round:
  floor      every worker fits on its own (no communication): the compute floor
  rx         `rx.DistributedOptimizer(optimizer)` in `model.compile`, as the README shows
  mwms       `MultiWorkerMirroredStrategy` (ring collectives over gRPC): model and optimizer
             made in its scope, TensorFlow's custom-loop recipe (`strategy.run` of a
             tape step in a `tf.function`, the dataset distributed by the strategy).
             Keras 3's `model.fit` does not run under this strategy (keras-team/keras#20585:
             "Attempt to convert a value (PerReplica...)"), so the loop is the fastest
             way TensorFlow itself offers a Keras 3 user across workers.
Each way's model is built once; every round, each way fits one untimed step and then the
same timed steps (`model.fit(..., steps_per_epoch=--steps)`); samples/s counts every
worker's samples; the time is the slowest worker's. Writes
results/keras_networks[_emulated].json and a plot.

Where:
  --hosts 1 (default)   --workers ranks as processes on this machine (TensorFlow's cluster
                        and raytrain-x's store on loopback)
  --hosts 2             an emulated cluster (network namespaces, one Ray node per host,
                        --link-gbit links): RayExecutor workers, TF_CONFIG on the hosts'
                        addresses; one world per --per-host value

Run alone: .venv/bin/python benchmarks/keras_networks.py [--hosts 2] [--repeats 5] [--steps 6]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

from raytrain_x.testing.waiting import free_port

from common import (
    add_place_arguments,
    drive_worlds,
    print_table,
    rss_mib,
    run_emulated,
    run_ranks,
    write_json,
)

BATCH = {"resnet18": 32, "gpt": 4}  # per worker, as in real_networks.py
WAYS = ("floor", "rx", "rx-dense", "mwms")


def _worker(rank: int, size: int, port: int, args, ports: list[int], queue) -> None:
    """One rank on this machine: TensorFlow's cluster on loopback, raytrain-x's TCP store."""
    os.environ.update({"RAYTRAIN_X_RANK": str(rank), "RAYTRAIN_X_SIZE": str(size),
                       "RAYTRAIN_X_STORE_ADDR": "127.0.0.1",
                       "RAYTRAIN_X_STORE_PORT": str(port)})
    out = _fit(args, [f"127.0.0.1:{p}" for p in ports], rank)
    if rank == 0:
        queue.put(out)


def _fit(args, cluster: list[str], index: int) -> dict:
    """Every way, interleaved round by round, in this process; `cluster` is TensorFlow's
    worker addresses and `index` this worker's place among them (its raytrain-x rank)."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": cluster},
                                          "task": {"type": "worker", "index": index}})
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)  # one thread per kernel, as torch
    # independent ops may run side by side (0: TensorFlow's default, one per core); with 1,
    # TensorFlow runs all of backward before any reduction kernel, so nothing overlaps
    tf.config.threading.set_inter_op_parallelism_threads(args.inter_op)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # before any other TF work
    import keras

    import raytrain_x.tensorflow as tfrx
    import raytrain_x.tensorflow.keras as rx
    from raytrain_x.tensorflow import workloads

    rx.init()
    rank, size = rx.rank(), rx.size()
    assert rank == index, (rank, index)

    def slowest(seconds: float) -> float:
        return float(tfrx.allreduce(tf.constant([seconds], tf.float64), op=tfrx.Max,
                                    name="slowest")[0])

    def dataset(name: str, batch: int, seed: int):
        if name == "resnet18":
            x, y = workloads.synthetic_images(batch, seed=seed)
        else:
            x, y = workloads.synthetic_tokens(batch, seed=seed)
        data = tf.data.Dataset.from_tensors((x, y)).repeat()
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.OFF)
        # tf.data's autotuning held whole rounds' steps to multiples of ~0.32 s with this
        # one-element pipeline (also in one process alone, without raytrain-x): off for
        # every way alike
        options.autotune.enabled = False
        return data.with_options(options)

    def build(name: str, way: str):
        model = workloads.resnet18() if name == "resnet18" else workloads.gpt_decoder()
        opt = (keras.optimizers.SGD(0.05, momentum=0.9) if name == "resnet18"
               else keras.optimizers.AdamW(3e-4))
        if way.startswith("rx"):
            opt = rx.DistributedOptimizer(opt, sparse_as_dense=way == "rx-dense")
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        return model

    def mirrored_loop(name: str, batch: int, seed: int):
        with strategy.scope():
            model = workloads.resnet18() if name == "resnet18" else workloads.gpt_decoder()
            opt = (keras.optimizers.SGD(0.05, momentum=0.9) if name == "resnet18"
                   else keras.optimizers.AdamW(3e-4))
        # each global batch is split across the replicas: `batch` samples per worker
        data = iter(strategy.experimental_distribute_dataset(
            dataset(name, batch * size, seed=seed)))

        def replica_step(x, y):
            with tf.GradientTape() as tape:
                per_sample = keras.losses.sparse_categorical_crossentropy(
                    y, model(x, training=True), from_logits=True)
                loss = tf.reduce_sum(per_sample) / (batch * size * (1 if name == "resnet18"
                                                                   else per_sample.shape[-1]))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        @tf.function
        def train_step():
            x, y = next(data)
            return strategy.run(replica_step, args=(x, y))

        def run(steps: int) -> None:
            for _ in range(steps):
                train_step()
        return run

    def fitting(name: str, way: str):
        model = build(name, way)
        data = dataset(name, batch=BATCH[name], seed=1000 * rank)

        def run(steps: int) -> None:
            model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
        return run

    out: dict[str, dict[str, list[float]]] = {}
    for name in args.workloads:
        batch = BATCH[name]
        out[name] = {w: [] for w in WAYS}
        # each way's model is built once and fitted again every round, as a job fits epoch
        # after epoch: TensorFlow keeps what every traced training step captured (the
        # weights and optimizer state of a model built afresh each round, ~400 MB for the
        # GPT) after the model is gone, clear_session and gc.collect notwithstanding
        # (tensorflow/tensorflow#61791), so 10 rounds of fresh models outgrew the VM
        runs = {way: mirrored_loop(name, batch, 0) if way == "mwms" else fitting(name, way)
                for way in WAYS}
        for run in runs.values():
            run(2)  # builds, traces and warms up
        for r in range(args.repeats):
            for way in WAYS:
                runs[way](1)  # this way's caches warm again after the others ran
                slowest(0.0)  # a barrier
                began = time.perf_counter()
                runs[way](args.steps)
                seconds = slowest((time.perf_counter() - began) / args.steps)
                out[name][way].append(batch * size / seconds)
                if rank == 0:
                    print(f"{name} round {r + 1}/{args.repeats} {way}: "
                          f"{batch * size / seconds:.1f} samples/s ({seconds:.3f} s/step) "
                          f"rss {rss_mib():.0f} MiB", flush=True)
        del runs, run
        keras.backend.clear_session()
        gc.collect()
    rx.shutdown()
    return out


# ----------------------------------------------------------------------------- emulated
def _address() -> dict:
    """In each RayExecutor worker: where its TensorFlow server will listen."""

    import ray

    ip = ray.util.get_node_ip_address()
    return {"address": f"{ip}:{free_port(ip)}", "pid": os.getpid()}


def _ray_worker(args, places: list[dict]) -> dict:
    index = [p["pid"] for p in places].index(os.getpid())  # ranks stay with their actors
    return _fit(args, [p["address"] for p in places], index)


def _drive(args) -> None:
    """The driver, on host 0 of the emulated cluster: one world per --per-host value."""
    def run(ex) -> dict:
        places = ex.run(_address)
        return ex.run(_ray_worker, args=[args, places])[0]

    drive_worlds(args.hosts, args.per_host, args.inside, run)


def plot(sections: dict[str, list[dict]], path: Path) -> None:
    """Samples/s of every way as a share of the floor, one panel per world."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sections), figsize=(5.5 * len(sections), 3.5),
                             squeeze=False)
    for ax, (title, rows) in zip(axes[0], sections.items()):
        names = list(dict.fromkeys(r["workload"] for r in rows))
        for i, way in enumerate(WAYS):
            values = [next(r["vs floor"] for r in rows
                           if r["workload"] == n and r["way"] == way) for n in names]
            ax.bar([j + i * 0.2 for j in range(len(names))], values, 0.2, label=way)
        ax.set_xticks([j + 0.3 for j in range(len(names))], names)
        ax.set_ylabel("samples/s / compute floor")
        ax.set_title(title, fontsize=9)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarise(got: dict[str, dict[str, list[float]]]) -> list[dict]:
    rows = []
    for name, ways in got.items():
        med = {w: statistics.median(v) for w, v in ways.items()}
        for way, values in ways.items():
            rows.append({"workload": name, "way": way, "samples/s": med[way],
                         "min": min(values), "max": max(values),
                         "spread %": 100 * (max(values) - min(values)) / med[way],
                         "vs floor": med[way] / med["floor"],
                         "vs mwms": med[way] / med["mwms"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["resnet18", "gpt"],
                        choices=sorted(BATCH))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per way and round")
    parser.add_argument("--inter-op", type=int, default=0,
                        help="TensorFlow's inter-op threads (0: its default)")
    add_place_arguments(parser)
    parser.add_argument("--json", default=None)
    parser.add_argument("--inside", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        _drive(args)
        return
    started = time.monotonic()
    if args.hosts == 1:
        ports = [free_port() for _ in range(args.workers)]
        worlds = {f"1 host x {args.workers}":
                  (args.workers, run_ranks(_worker, args.workers, args, ports))}
        where = "keras_networks"
    else:
        raw = run_emulated(__file__, sys.argv[1:], args.hosts, max(args.per_host),
                           args.link_gbit)
        worlds = {f"{args.hosts} hosts x {k} ({args.link_gbit:g} Gbit/s)":
                  (args.hosts * int(k), v) for k, v in raw.items()}
        where = "keras_networks_emulated"
    payload: dict = {"repeats": args.repeats, "steps": args.steps, "batch_per_worker": BATCH,
                     "inter_op_threads": args.inter_op,
                     "link_gbit": args.link_gbit if args.hosts > 1 else None, "worlds": {}}
    sections = {}
    for title, (workers, got) in worlds.items():
        rows = summarise(got)
        print(f"\n{title}")
        print_table(rows, ["workload", "way", "samples/s", "min", "max", "spread %",
                           "vs floor", "vs mwms"])
        payload["worlds"][title] = {"workers": workers, "samples_per_s": got, "rows": rows}
        sections[title] = rows
    payload["seconds"] = round(time.monotonic() - started, 1)
    path = write_json(where, payload, args.json)
    plot(sections, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
