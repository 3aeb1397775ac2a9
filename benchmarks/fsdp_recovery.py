"""An FSDP2-sharded GPT losing and gaining a worker: raytrain-x's in-memory re-shard against
Ray Train's `TorchTrainer` restarting FSDP2 from its latest DCP checkpoint, the way a Ray
user restarts today. A local Ray cluster (`ray.cluster_utils.Cluster`): a head that runs no
workers and 1-CPU nodes, one worker each. The same model (`--vocab/--layers/--width`,
AdamW), the same steps, every way run in turn, --repeats times:

  elastic        RayExecutor(min_workers=2, max_workers=3), `TorchState(model, optimizer,
                 replicas=1)` committed every step; the youngest worker SIGKILLed at step 10:
                 the two left re-shard the last commit in memory
  torch_trainer  TorchTrainer(num_workers=3, FailureConfig(max_failures=1)), FSDP2 over its
                 gloo group, the model's and optimizer's DCP state dicts saved every step
                 (`torch.distributed.checkpoint`, to a shared local path); a worker
                 SIGKILLed at step 10: Ray Train restarts the group, which loads the latest
                 checkpoint
  add            the elastic job on 2 nodes; a third node added at step 10: the longest
                 pause between two of rank 0's steps around the join, against the step
                 time before it, and the bytes the newcomer received

Recovery: the time from the kill to the first step after it. Writes
results/fsdp_recovery.json.

Run: .venv/bin/python benchmarks/fsdp_recovery.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import ray

from raytrain_x.testing.waiting import wait_until

from common import add_small_gpt_arguments, print_table, write_json

RESOURCE = "fsdp_slot"
KILL_AT = 10
STEPS = 30


def _model(config: dict):
    from raytrain_x.torch.workloads import GPTDecoder

    return GPTDecoder(vocab=config["vocab"], layers=config["layers"], width=config["width"],
                      heads=4, seq=config["seq"])


def _step(net, opt, config: dict, step: int, rank: int) -> None:
    import torch

    from raytrain_x.torch.workloads import synthetic_tokens

    ids, targets = synthetic_tokens(config["batch"], seq=config["seq"], vocab=config["vocab"],
                                    seed=1000 * step + rank)
    opt.zero_grad()
    logits = net(ids)
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                      targets.reshape(-1)).backward()
    opt.step()


def _note(config: dict, step: int, size: int, rank: int) -> None:
    """Rank 0's "time step size" line; every rank's pid (the killer picks one)."""
    Path(config["pids"], str(os.getpid())).touch()
    if rank == 0:
        with open(config["progress"], "a") as f:
            f.write(f"{time.time()} {step} {size}\n")


def _elastic(config: dict) -> int:
    import torch
    from torch.distributed.fsdp import fully_shard

    import raytrain_x.torch as rx

    torch.set_num_threads(1)
    rx.init()
    net = _model(config)
    mesh = rx.device_mesh()
    for block in net.blocks.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    state = rx.elastic.TorchState(net, opt, replicas=1, step=0)

    @rx.elastic.run
    def train(state) -> int:
        while state.step < STEPS:
            _step(net, opt, config, state.step, rx.rank())
            state.step += 1
            state.commit()
            _note(config, state.step, rx.size(), rx.rank())
        return state.step

    return train(state)


def _trainer_loop(config: dict) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    rank, size = dist.get_rank(), dist.get_world_size()
    net = _model(config)
    mesh = init_device_mesh("cpu", (size,))
    for block in net.blocks.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    root = Path(config["checkpoints"])
    done = sorted((int(p.name), p) for p in root.glob("*") if (p / ".metadata").exists())
    step = 0
    if done:  # the latest complete checkpoint (its metadata is written last)
        step, folder = done[-1]
        model_state, optim_state = get_state_dict(net, opt)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(folder))
        set_state_dict(net, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    while step < STEPS:
        _step(net, opt, config, step, rank)
        step += 1
        model_state, optim_state = get_state_dict(net, opt)
        dcp.save({"model": model_state, "optim": optim_state},
                 checkpoint_id=str(root / f"{step:06d}"))
        _note(config, step, size, rank)


def _steps(progress: Path) -> list[tuple[float, int, int]]:
    if not progress.exists():
        return []
    return [(float(t), int(s), int(n)) for t, s, n in
            (line.split() for line in progress.read_text().splitlines() if line.strip())]


def _kill_at(config: dict, out: dict) -> None:
    """SIGKILLs the youngest worker process once rank 0 finished step `KILL_AT`."""
    def run() -> None:
        progress = Path(config["progress"])
        wait_until(lambda: any(s >= KILL_AT for _, s, _ in _steps(progress)), 600,
                   f"step {KILL_AT}")
        victim = max(int(p.name) for p in Path(config["pids"]).iterdir())
        out["killed_at"] = time.time()
        os.kill(victim, signal.SIGKILL)

    threading.Thread(target=run, daemon=True).start()


def _config(tmp: Path, args, way: str) -> dict:
    for sub in ("pids", "checkpoints"):
        (tmp / f"{way}-{sub}").mkdir()
    return {"progress": str(tmp / f"{way}.txt"), "pids": str(tmp / f"{way}-pids"),
            "checkpoints": str(tmp / f"{way}-checkpoints"), "vocab": args.vocab,
            "layers": args.layers, "width": args.width, "seq": args.seq,
            "batch": args.batch}


def _after(progress: Path, t0: float, size: int | None = None) -> float:
    return min(t for t, _, n in _steps(progress)
               if t > t0 and (size is None or n == size)) - t0


def measure_elastic(tmp: Path, args) -> float:
    from raytrain_x.ray import RayExecutor

    config, out = _config(tmp, args, "elastic"), {}
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=20), min_workers=2,
                           max_workers=3, cpus_per_worker=1, resources_per_worker={RESOURCE: 1},
                           cooldown_range=(600, 900))
    executor.start()
    try:
        _kill_at(config, out)
        executor.run(_elastic, args=(config,))
    finally:
        executor.shutdown()
    return _after(Path(config["progress"]), out["killed_at"], size=2)


def measure_torch_trainer(tmp: Path, args) -> float:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    config, out = _config(tmp, args, "trainer"), {}
    _kill_at(config, out)
    TorchTrainer(_trainer_loop, torch_config=TorchConfig(backend="gloo"),
                 train_loop_config=config,
                 scaling_config=ScalingConfig(num_workers=3,
                                              resources_per_worker={"CPU": 1, RESOURCE: 1}),
                 run_config=RunConfig(name="fsdp", storage_path=str(tmp / "ray-storage"),
                                      failure_config=FailureConfig(max_failures=1))).fit()
    return _after(Path(config["progress"]), out["killed_at"])


def measure_add(cluster, tmp: Path, args) -> dict:
    """The elastic job from 2 workers; a node added at step `KILL_AT` (Ray adds nodes from
    the main thread: the job runs on another)."""
    from raytrain_x.ray import RayExecutor

    config = _config(tmp, args, "add")
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=20), min_workers=2,
                           max_workers=3, cpus_per_worker=1, resources_per_worker={RESOURCE: 1})
    executor.start()
    progress = Path(config["progress"])
    failed: list[BaseException] = []

    def run() -> None:
        try:
            executor.run(_elastic, args=(config,))
        except BaseException as exc:  # noqa: BLE001 - raised on the main thread
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: failed or any(s >= KILL_AT for _, s, _ in _steps(progress)), 600,
                   f"step {KILL_AT}")
        added_at = time.time()
        node = cluster.add_node(num_cpus=1, resources={RESOURCE: 1})
        thread.join()
    finally:
        executor.shutdown()
    if failed:
        raise failed[0]
    cluster.remove_node(node)
    steps = _steps(progress)
    times = [t for t, _, _ in steps]
    gaps = [b - a for a, b in zip(times, times[1:])]
    before = [g for (t, _, n), g in zip(steps[1:], gaps) if n == 2 and t < added_at]
    grown = next(i for i, (_, _, n) in enumerate(steps) if n == 3)
    around = gaps[max(0, grown - 3):grown + 1]
    return {"step_s": statistics.median(before), "longest_pause_s": max(around),
            "pause_over_step_s": max(around) - statistics.median(before)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    add_small_gpt_arguments(parser)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False})
    runs: dict[str, list] = {"elastic": [], "torch_trainer": [], "add": []}
    try:
        nodes = [cluster.add_node(num_cpus=1, resources={RESOURCE: 1}) for _ in range(3)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, runtime_env={
            "env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent)}})
        for i in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                runs["elastic"].append(measure_elastic(Path(tmp), args))
                print(f"repeat {i + 1}: elastic {runs['elastic'][-1]:.2f}s", flush=True)
                runs["torch_trainer"].append(measure_torch_trainer(Path(tmp), args))
                print(f"repeat {i + 1}: torch_trainer {runs['torch_trainer'][-1]:.2f}s",
                      flush=True)
                cluster.remove_node(nodes.pop())
                runs["add"].append(measure_add(cluster, Path(tmp), args))
                print(f"repeat {i + 1}: add {runs['add'][-1]}", flush=True)
                nodes.append(cluster.add_node(num_cpus=1, resources={RESOURCE: 1}))
                cluster.wait_for_nodes()
    finally:
        ray.shutdown()
        cluster.shutdown()
    elastic, trainer = (statistics.median(runs[w]) for w in ("elastic", "torch_trainer"))
    pause = statistics.median(r["pause_over_step_s"] for r in runs["add"])
    print_table([{"way": "elastic (kill)", "median s": elastic},
                 {"way": "torch_trainer (kill)", "median s": trainer},
                 {"way": "add: longest pause beyond a step", "median s": pause}],
                ["way", "median s"])
    ratio = elastic / trainer
    print(f"elastic / torch_trainer: {ratio:.3f} (target <= 0.2)")
    payload = {"args": vars(args), "runs": runs, "elastic_s": elastic,
               "torch_trainer_s": trainer, "elastic_over_torch_trainer": ratio,
               "add_pause_beyond_step_s": pause}
    print(f"wrote {write_json('fsdp_recovery', payload, args.json)}")


if __name__ == "__main__":
    main()
