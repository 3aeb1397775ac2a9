"""A churn schedule through Ray Train's API: raytrain-x's elastic trainer
(`RaytrainXTrainer`, `ScalingConfig(num_workers=(1, 3))`, the world changed in memory) side
by side with Ray Train v2's own elastic mode (`TorchTrainer` with the same scaling, which
restarts its worker group from the latest checkpoint on every change).

Both train the same model on the same Ray Data dataset (rows carrying ids, features made
upstream by `map_batches`), with the same batch, seeds and checkpoint cadence, for the same
number of epochs, on a local multi-node cluster whose worker nodes are added and killed on
a fixed schedule (scaled down from Ray's own elastic benchmark, which changes the GPU count
every 300 s for an hour): 2 nodes at the start, then a node added, a node killed, in turn,
every --change-every seconds, --changes times (then the cluster stays as it is, so a
trainer that cannot get ahead between changes still finishes; the node a kill takes is
drawn by a seeded generator, the same draws for both trainers). Ray Train's
`elastic_resize_monitor_interval_s` is scaled down with it (--monitor-s; Ray's default is 60 s).

Reported per trainer: end-to-end samples/s (the epochs' rows over the fit's wall time, from
`fit()` to its return), restarts, and the row accounting of the committed history: rows
trained twice or skipped in an epoch, and samples trained and then thrown away (Ray Train's
steps after its latest checkpoint, done again after each restart). raytrain-x's rows are
counted from its committed state (each epoch's ids, gathered from every rank at each step).

Run alone: .venv/bin/python benchmarks/elastic_trainer_churn.py [--epochs 4]
Writes results/elastic_trainer_churn.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from common import print_table, write_json

WAYS = ("raytrain_x", "ray_train")
RESOURCE = "churn_worker"  # each worker node has one; training workers take it
DATA_RESOURCE = "churn_data"  # the head's: Ray Data's tasks take it
FEATURES = 256


def _features(batch: dict) -> dict:
    """Each row's features and label, a function of its id (made upstream, streaming)."""
    import numpy as np

    ids = batch["id"]
    rng = np.random.default_rng(ids[0] if len(ids) else 0)
    x = rng.standard_normal((len(ids), FEATURES)).astype("float32")
    return {"id": ids, "x": x, "y": (ids % 10).astype("int64")}


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 2048), torch.nn.ReLU(),
                               torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
                               torch.nn.Linear(2048, 10))


def _raytrain_x_loop(config: dict) -> dict:
    import tempfile
    import time

    import ray.train
    import torch
    from ray.train import Checkpoint

    import raytrain_x.torch as rx

    torch.set_num_threads(1)
    rx.init()
    model = _model()
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                  named_parameters=model.named_parameters())
    shard = ray.train.get_dataset_shard("train")
    state = rx.elastic.TorchState(model, opt, data=shard, epoch=0, seen=[], steps=0)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            saved = torch.load(os.path.join(folder, "state.pt"), weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state.epoch, state.seen, state.steps = saved["epoch"], saved["seen"], saved["steps"]

    def report(metrics: dict) -> None:
        with tempfile.TemporaryDirectory() as folder:
            if rx.rank() == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "epoch": state.epoch, "seen": state.seen, "steps": state.steps},
                           os.path.join(folder, "state.pt"))
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))

    @rx.elastic.run
    def train(state):
        while state.epoch < config["epochs"]:
            for batch in state.data.iter_torch_batches(batch_size=config["batch"]):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"]).backward()
                opt.step()
                state.seen.append(rx.allgather_object(batch["id"].tolist(), name="ids"))
                state.steps += 1
                state.commit()
                if state.steps % config["checkpoint_every"] == 0:
                    report({"epoch": state.epoch, "steps": state.steps})
            counts = Counter(i for step in state.seen for ids in step for i in ids)
            report({"epoch": state.epoch, "steps": state.steps, "end": True,
                    "twice": sum(c > 1 for c in counts.values()),
                    "skipped": config["rows"] - len(counts), "time": time.time()})
            state.epoch, state.seen = state.epoch + 1, []
            state.commit()
        return state.steps

    return train(state)


def _ray_train_loop(config: dict) -> None:
    """Ray Train's elastic loop as its users write it: restore the latest checkpoint (epoch
    and the batches done in it) and skip that many batches of the new shard."""
    import json
    import tempfile

    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed
    from ray.train import Checkpoint

    torch.set_num_threads(1)
    context = ray.train.get_context()
    model = ray.train.torch.prepare_model(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    epoch, done, steps = 0, 0, 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            saved = torch.load(os.path.join(folder, "state.pt"), weights_only=False)
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        epoch, done, steps = saved["epoch"], saved["done"], saved["steps"]
    # this worker group's number (the groups run one after another): rank 0's count
    attempt = [len(list(Path(config["log"]).glob("restored-*")))]
    torch.distributed.broadcast_object_list(attempt, src=0)
    attempt = attempt[0]
    if context.get_world_rank() == 0:
        with open(os.path.join(config["log"], f"restored-{attempt}"), "w") as f:
            f.write(str(steps))
    log = open(os.path.join(config["log"], f"{attempt}-{context.get_world_rank()}-"
                                          f"{os.getpid()}.jsonl"), "a")

    def report(metrics: dict, batches_done: int) -> None:
        with tempfile.TemporaryDirectory() as folder:
            if context.get_world_rank() == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "epoch": epoch, "done": batches_done, "steps": steps},
                           os.path.join(folder, "state.pt"))
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))

    shard = ray.train.get_dataset_shard("train")
    while epoch < config["epochs"]:
        for i, batch in enumerate(shard.iter_torch_batches(batch_size=config["batch"])):
            if i < done:
                continue  # done before the checkpoint (by the world before the restart)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"]).backward()
            opt.step()
            steps += 1
            log.write(json.dumps([steps, epoch, batch["id"].tolist()]) + "\n")
            log.flush()
            if steps % config["checkpoint_every"] == 0:
                report({"epoch": epoch, "steps": steps}, i + 1)
        epoch, done = epoch + 1, 0
        report({"epoch": epoch, "steps": steps, "end": True}, 0)
    log.close()


def _ray_train_accounting(log_dir: str, rows: int, epochs: int) -> dict:
    """Ray Train's committed history from its workers' logs: an attempt's steps up to the
    step the next attempt restored count; the rest were thrown away."""
    restored = {int(p.name.split("-")[1]): int(p.read_text())
                for p in Path(log_dir).glob("restored-*")}
    counts: list[Counter] = [Counter() for _ in range(epochs)]
    wasted = 0
    for path in Path(log_dir).glob("*.jsonl"):
        attempt = int(path.name.split("-")[0])
        keep_to = restored.get(attempt + 1, float("inf"))
        for line in path.read_text().splitlines():
            step, epoch, ids = json.loads(line)
            if step > keep_to:
                wasted += len(ids)
            else:
                counts[epoch].update(ids)
    return {"restarts": max(restored) if restored else 0, "wasted_samples": wasted,
            "twice": sum(sum(c > 1 for c in e.values()) for e in counts),
            "skipped": sum(rows - len(e) for e in counts)}


def _dataset(rows: int):
    import ray.data

    # Ray Data's tasks run on the head (a task on a node being killed would stall the
    # stream until Ray declares the node dead, for either trainer)
    return ray.data.range(rows, override_num_blocks=16).map_batches(
        _features, resources={DATA_RESOURCE: 1})


def fit(way: str, args, cluster, storage: str) -> dict:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from raytrain_x.ray.train import RaytrainXConfig, RaytrainXTrainer

    log_dir = tempfile.mkdtemp(prefix="rtx_churn_log_")
    config = {"epochs": args.epochs, "batch": args.batch, "rows": args.rows,
              "checkpoint_every": args.checkpoint_every, "log": log_dir}
    common = {
        "train_loop_config": config,
        "scaling_config": ScalingConfig(num_workers=(1, 3),
                                        resources_per_worker={"CPU": 1, RESOURCE: 1},
                                        elastic_resize_monitor_interval_s=args.monitor_s),
        "run_config": RunConfig(name=f"{way}-{time.monotonic_ns()}", storage_path=storage,
                                failure_config=FailureConfig(max_failures=-1),
                                checkpoint_config=CheckpointConfig(num_to_keep=2)),
        "datasets": {"train": _dataset(args.rows)}}
    if way == "raytrain_x":
        trainer = RaytrainXTrainer(_raytrain_x_loop,
                                   raytrain_x_config=RaytrainXConfig(framework="torch"),
                                   **common)
    else:
        trainer = TorchTrainer(_ray_train_loop, torch_config=TorchConfig(backend="gloo"),
                               **common)
    nodes = [cluster.add_node(num_cpus=1, resources={RESOURCE: 1}) for _ in range(2)]
    cluster.wait_for_nodes()
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - reported below
            out["error"] = exc

    began = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    changes = []
    k = 0
    victims = random.Random(args.seed)  # which node a kill takes: the same for both ways
    while thread.is_alive():
        thread.join(0.5)
        if thread.is_alive() and k < args.changes and \
                time.monotonic() - began >= (k + 1) * args.change_every:
            if k % 2 == 0:
                nodes.append(cluster.add_node(num_cpus=1, resources={RESOURCE: 1}))
                changes.append(("add", round(time.monotonic() - began, 1)))
            else:
                cluster.remove_node(nodes.pop(victims.randrange(len(nodes))),
                                    allow_graceful=False)
                changes.append(("kill", round(time.monotonic() - began, 1)))
            print(f"  {way}: {changes[-1][0]} a node at {changes[-1][1]} s", flush=True)
            k += 1
    wall = time.monotonic() - began
    for node in nodes:
        cluster.remove_node(node, allow_graceful=True)
    if "error" in out:
        raise out["error"]
    result = out["result"]
    row = {"way": way, "wall_s": wall, "samples_per_s": args.epochs * args.rows / wall,
           "changes": changes}
    if way == "raytrain_x":
        ends = result.metrics_dataframe
        ends = ends[ends["end"].notna()] if "end" in ends else ends
        row.update({"restarts": 0, "wasted_samples": 0, "twice": int(ends["twice"].sum()),
                    "skipped": int(ends["skipped"].sum())})
    else:
        row.update(_ray_train_accounting(log_dir, args.rows, args.epochs))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--rows", type=int, default=6000)
    parser.add_argument("--batch", type=int, default=32, help="rows per worker per step")
    parser.add_argument("--checkpoint-every", type=int, default=25, help="steps")
    parser.add_argument("--change-every", type=float, default=30.0, help="seconds")
    parser.add_argument("--changes", type=int, default=6,
                        help="changes in all; then the cluster stays as it is")
    parser.add_argument("--monitor-s", type=float, default=5.0,
                        help="Ray Train's elastic_resize_monitor_interval_s")
    parser.add_argument("--seed", type=int, default=0, help="which nodes the kills take")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray Data's tasks and the drivers' actors on the head; training workers on the nodes.
    # Ray's own health checks (a faster one declares loaded live nodes dead on 2 cores).
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {DATA_RESOURCE: 2}, "include_dashboard": False})
    rows = []
    try:
        ray.init(address=cluster.address, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.path.dirname(__file__)}})
        with tempfile.TemporaryDirectory(prefix="rtx_churn_") as storage:
            for way in args.ways:
                print(f"{way}: {args.epochs} epochs of {args.rows} rows, a change every "
                      f"{args.change_every:.0f} s", flush=True)
                rows.append(fit(way, args, cluster, storage))
                print(f"  {way}: {rows[-1]['samples_per_s']:.0f} samples/s in "
                      f"{rows[-1]['wall_s']:.0f} s", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    base = next((r for r in rows if r["way"] == "ray_train"), None)
    for row in rows:
        row["vs Ray Train"] = row["samples_per_s"] / base["samples_per_s"] if base else None
    print_table(rows, ["way", "samples_per_s", "wall_s", "restarts", "wasted_samples",
                       "twice", "skipped", "vs Ray Train"])
    path = write_json("elastic_trainer_churn", {"args": vars(args), "rows": rows}, args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
