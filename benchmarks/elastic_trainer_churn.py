"""A churn schedule through Ray Train's API: raytrain-x's elastic trainer
(`RaytrainXTrainer`, `ScalingConfig(num_workers=(1, 3))`, the world changed in memory) side
by side with Ray Train v2's own elastic mode (`TorchTrainer` with the same scaling, which
restarts its worker group from the latest checkpoint on every change).

Both train the same model on the same Ray Data dataset (rows carrying ids, features made
upstream by `map_batches`), with the same batch, seeds and checkpoint cadence, for the same
number of epochs, on a local multi-node cluster of 1-CPU worker nodes: 2 at the start, then
a node added, a node killed, in turn, --changes times. The changes come at points of
training progress, not of wall time, so both trainers meet the same changes at the same
places: change k when the run's furthest position (epoch and rows done in it, as the
trainer's rank 0 last wrote it) first reaches k/(changes+1) of all the rows to train. The
node a kill takes is drawn by a seeded generator, the same draws for every run.

Each trainer also runs without churn (the 2 nodes throughout), so its churn factor (its
samples/s with churn over its own without) is apart from its own speed. Ray Train runs at
its default `elastic_resize_monitor_interval_s` (60 s) and at 5 s; the better of the two is
the baseline of the ratio. The runs alternate, --repeats times; medians are reported.

Reported per run: end-to-end samples/s (the epochs' rows over the fit's wall time, from
`fit()` to its return), restarts, and the row accounting of the committed history: rows
trained twice or skipped in an epoch, and samples trained and then thrown away (Ray Train's
steps after its latest checkpoint, done again after each restart). raytrain-x's rows are
counted from its committed state (each epoch's ids, gathered from every rank at each step).

Run alone: .venv/bin/python benchmarks/elastic_trainer_churn.py [--repeats 2]
Writes results/elastic_trainer_churn.json and results/elastic_trainer_churn.png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
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


def _progress(config: dict, epoch: int, rows_done: int) -> None:
    """Rank 0's position (rows of all epochs before, and this one's done) for the churn
    schedule: written whole (the driver reads it while it changes)."""
    path = Path(config["log"]) / "progress"
    path.with_suffix(".tmp").write_text(str(epoch * config["rows"] + rows_done))
    os.replace(path.with_suffix(".tmp"), path)


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
                if rx.rank() == 0:
                    _progress(config, state.epoch, sum(len(i) for s in state.seen for i in s))
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
            if context.get_world_rank() == 0:
                _progress(config, epoch, (i + 1) * config["batch"] * context.get_world_size())
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


def fit(way: str, monitor_s: float, changes: int, args, cluster, storage: str) -> dict:
    """One run of `way` through `changes` changes (0: the 2 nodes throughout)."""
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
                                        elastic_resize_monitor_interval_s=monitor_s),
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

    total = args.epochs * args.rows
    progress = Path(log_dir) / "progress"
    began = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    done: list[tuple] = []
    furthest = 0
    victims = random.Random(args.seed)  # which node a kill takes: the same for every run
    while thread.is_alive():
        thread.join(0.2)
        if progress.exists():
            furthest = max(furthest, int(progress.read_text() or 0))
        k = len(done)
        if thread.is_alive() and k < changes and furthest >= (k + 1) * total / (changes + 1):
            if k % 2 == 0:
                nodes.append(cluster.add_node(num_cpus=1, resources={RESOURCE: 1}))
            else:
                cluster.remove_node(nodes.pop(victims.randrange(len(nodes))),
                                    allow_graceful=False)
            done.append(("add" if k % 2 == 0 else "kill", furthest,
                         round(time.monotonic() - began, 1)))
            print(f"    {done[-1][0]} a node at {furthest} of {total} rows "
                  f"({done[-1][2]} s)", flush=True)
    wall = time.monotonic() - began
    for node in nodes:
        cluster.remove_node(node, allow_graceful=True)
    if "error" in out:
        raise out["error"]
    result = out["result"]
    row = {"way": way, "monitor_s": monitor_s if way == "ray_train" else None,
           "churn": changes > 0, "wall_s": wall, "samples_per_s": total / wall,
           "changes": done}
    if way == "raytrain_x":
        ends = result.metrics_dataframe
        ends = ends[ends["end"].notna()] if "end" in ends else ends
        row.update({"restarts": 0, "wasted_samples": 0, "twice": int(ends["twice"].sum()),
                    "skipped": int(ends["skipped"].sum())})
    else:
        row.update(_ray_train_accounting(log_dir, args.rows, args.epochs))
    return row


def _label(row: dict) -> str:
    return row["way"] if row["monitor_s"] is None else f"ray_train@{row['monitor_s']:g}s"


def summarize(rows: list[dict]) -> list[dict]:
    """Per trainer (and Ray Train's interval): the medians with churn and without, the
    churn factor, and the ratio to the better Ray Train with churn."""
    out = []
    for label in dict.fromkeys(_label(r) for r in rows if r["churn"]):
        churn = [r for r in rows if r["churn"] and _label(r) == label]
        calm = [r for r in rows if not r["churn"] and r["way"] == churn[0]["way"]]
        rate = statistics.median(r["samples_per_s"] for r in churn)
        calm_rate = statistics.median(r["samples_per_s"] for r in calm) if calm else None
        out.append({"trainer": label, "runs": len(churn), "samples_per_s": rate,
                    "no_churn_samples_per_s": calm_rate,
                    "churn_factor": rate / calm_rate if calm_rate else None,
                    "restarts": statistics.median(r["restarts"] for r in churn),
                    "wasted_samples": statistics.median(r["wasted_samples"] for r in churn),
                    "twice": max(r["twice"] for r in churn),
                    "skipped": max(r["skipped"] for r in churn)})
    best = max((o["samples_per_s"] for o in out if o["trainer"].startswith("ray_train")),
               default=None)
    for o in out:
        o["vs_best_ray_train"] = o["samples_per_s"] / best if best else None
    return out


def plot(rows: list[dict], summary: list[dict], path: Path) -> None:
    """Each run's samples/s, with churn and without, per trainer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [o["trainer"] for o in summary]
    for x, label in enumerate(labels):
        way = label.split("@")[0]
        churn = [r["samples_per_s"] for r in rows if r["churn"] and _label(r) == label]
        calm = [r["samples_per_s"] for r in rows if not r["churn"] and r["way"] == way]
        ax.scatter([x - 0.1] * len(churn), churn, color="tab:red", label="churn" if x == 0
                   else None)
        ax.scatter([x + 0.1] * len(calm), calm, color="tab:gray", label="no churn" if x == 0
                   else None)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("samples/s (end to end)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("The same churn at the same training progress")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--rows", type=int, default=6000)
    parser.add_argument("--batch", type=int, default=32, help="rows per worker per step")
    parser.add_argument("--checkpoint-every", type=int, default=25, help="steps")
    parser.add_argument("--changes", type=int, default=4,
                        help="changes in all, spread evenly over the rows to train")
    parser.add_argument("--monitor-s", type=float, nargs="+", default=[60.0, 5.0],
                        help="Ray Train's elastic_resize_monitor_interval_s (each is run)")
    parser.add_argument("--repeats", type=int, default=2)
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
    plan = []  # (way, monitor_s, changes): alternating, each repeat in turn
    for repeat in range(args.repeats):
        runs = [(w, m, args.changes) for w in args.ways
                for m in (args.monitor_s if w == "ray_train" else [1.0])]
        runs += [(w, args.monitor_s[0] if w == "ray_train" else 1.0, 0) for w in args.ways]
        plan += runs if repeat % 2 == 0 else runs[::-1]
    rows = []
    try:
        ray.init(address=cluster.address, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [
                     os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))}})
        with tempfile.TemporaryDirectory(prefix="rtx_churn_") as storage:
            for n, (way, monitor_s, changes) in enumerate(plan, 1):
                print(f"[{n}/{len(plan)}] {way}" + (f" (resize interval {monitor_s:g} s)"
                      if way == "ray_train" else "") + f": {args.epochs} epochs of "
                      f"{args.rows} rows, {changes} changes", flush=True)
                rows.append(fit(way, monitor_s, changes, args, cluster, storage))
                print(f"    {rows[-1]['samples_per_s']:.0f} samples/s in "
                      f"{rows[-1]['wall_s']:.0f} s, {rows[-1]['restarts']} restarts", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    summary = summarize(rows)
    print_table(summary, ["trainer", "runs", "samples_per_s", "no_churn_samples_per_s",
                          "churn_factor", "restarts", "wasted_samples", "twice", "skipped",
                          "vs_best_ray_train"])
    path = write_json("elastic_trainer_churn", {"args": vars(args), "rows": rows,
                                                "summary": summary}, args.json)
    plot(rows, summary, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
