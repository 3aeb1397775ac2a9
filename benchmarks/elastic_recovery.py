"""Time from losing a worker to the first completed training step without it.

One node (a local Ray cluster), a worker actor killed; same job, same run, two ways:
  elastic      RayExecutor(min_workers=2, max_workers=3): survivors restore the last
               in-memory commit and go on in a new rendezvous round
  checkpoint   RayExecutor(num_workers=3) saving a checkpoint every step; after the kill
               the job is started again and resumes from the checkpoint (Ray Train's way)

Nodes (--nodes, on by default): a local autoscaling cluster (raytrain_x.testing: Ray's fake
multi-node provider, one 1-CPU raylet per node, the head runs no workers), one worker per
node, 3 workers; one node is lost three ways:
  drain        a preemption notice (the GCS drain `ray drain-node` sends, 60 s deadline):
               the node's worker leaves at the next commit, nothing is restored
  kill         every process of the node killed (SIGKILL): survivors restore the commit
  checkpoint   a node killed under RayExecutor(num_workers=3) saving every step; the job
               restarts on the 2 nodes left from the checkpoint
and grown: from the job's request to the autoscaler (head only, nothing started) to its
first step with 3 workers.
Writes results/elastic_recovery.json. With --zero, only the elastic recovery with AdamW
unsharded and sharded (zero_stage 0, 1, 2; results/elastic_recovery_zero.json).

With --storage, the whole job lost at step 20, on the same model (AdamW) and the same 2
workers:
  durable        RayExecutor(min_workers=2, checkpoint=CheckpointConfig(...)) to a local
                 path, the step before the loss checkpointed (`state.checkpoint()`), every
                 worker's process exiting by itself: new workers restore the checkpoint (no
                 holder of the state is left)
  durable_killed the same, every worker SIGKILLed from outside (the benchmark's process
                 kills them once both wait at step 20): the driver finds them gone
  durable_s3     the same kill, the checkpoints on an S3 server (moto's, on loopback, in the
                 benchmark's process)
  torch_trainer  Ray Train's TorchTrainer(FailureConfig(max_failures=1)) to a local path, a
                 checkpoint reported every step, every worker's process exiting by itself:
                 Ray Train restarts the worker group from it
Time from the loss (the kill) to the first step after it
(results/elastic_recovery_storage.json).

With --trainer, a worker of three SIGKILLed at step 20 under the elastic trainer
(`RaytrainXTrainer`, `ScalingConfig(num_workers=(2, 3))`) and under `RayExecutor(min_workers=2,
max_workers=3)`, the same job: the time from the kill to the first step of the two left
(results/elastic_recovery_trainer.json).

With --discovery, Horovod's hosts changing under the job (benchmarks/elastic_discovery.py):
a host added to and removed from a discovery script's output, the time to the new world's
first step and the survivors' stall (results/elastic_discovery.json).

Run: .venv/bin/python benchmarks/elastic_recovery.py [--repeats 3] [--no-nodes] [--zero]
     [--storage] [--trainer] [--discovery]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import ray

from raytrain_x.testing.waiting import wait_until

from common import print_table, write_json

STEPS = 60


def _train(progress: str, checkpoint: str | None, elastic: bool,
           until: str | None = None, zero_stage: int | None = None) -> tuple[int, int]:
    """The job; with `zero_stage` (0, 1 or 2), AdamW whose state is sharded at 1 and 2."""
    import torch

    import raytrain_x.torch as rx
    from raytrain_x.common.workloads import resnet50_parameter_shapes
    from raytrain_x.torch.workloads import shaped_model

    rx.init()
    torch.set_num_threads(1)
    model = shaped_model(resnet50_parameter_shapes()[:60])  # ~3M parameters
    inner = (torch.optim.SGD(model.parameters(), lr=1e-4) if zero_stage is None else
             torch.optim.AdamW(model.parameters(), lr=1e-4))
    opt = rx.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                  zero_stage=zero_stage or 0)
    step0 = 0
    if checkpoint and os.path.exists(checkpoint):
        saved = torch.load(checkpoint)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        step0 = saved["step"]

    def one_step(step: int) -> None:
        opt.zero_grad()
        model(torch.ones(())).backward()
        opt.step()
        if rx.rank() == 0:
            with open(progress, "a") as f:
                f.write(f"{time.time()} {step} {rx.size()}\n")

    def stop() -> bool:  # every rank stops at the same step
        return until is not None and rx.broadcast_object(
            rx.rank() == 0 and os.path.exists(until), 0, name="until")

    if elastic:
        state = rx.elastic.TorchState(model, opt, step=0)

        @rx.elastic.run
        def train(state):
            while (state.step < STEPS or until) and not stop():
                one_step(state.step)
                state.step += 1
                state.commit()
            return state.step, rx.elastic.restore_count()

        return train(state)
    step = step0
    while (step < STEPS or until) and not stop():
        one_step(step)
        if rx.rank() == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "step": step + 1}, checkpoint)
        rx.barrier()
        step += 1
    return step, 0


def _steps(progress: Path) -> list[tuple[float, int, int]]:
    """(time, step, world size) of every step rank 0 finished."""
    if not progress.exists():
        return []
    return [(float(t), int(s), int(n)) for t, s, n in
            (line.split() for line in progress.read_text().splitlines() if line.strip())]


def _kill_when(executor_ref, progress: Path, at_step: int, out: dict) -> threading.Thread:
    def run():
        while not any(s >= at_step for _, s, _ in _steps(progress)):
            time.sleep(0.02)
        executor = executor_ref()
        if executor.elastic:
            victim = max(executor.last_elastic_job.members.values(), key=lambda m: m.age).actor
        else:
            victim = executor.workers[-1]
        out["killed_at"] = time.time()
        ray.kill(victim, no_restart=True)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def measure_elastic(tmp: Path, zero_stage: int | None = None) -> float:
    from raytrain_x.ray import RayExecutor

    progress = tmp / f"elastic{zero_stage}.txt"
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=20), min_workers=2,
                           max_workers=3, cpus_per_worker=1)
    executor.start()
    out: dict = {}
    _kill_when(lambda: executor, progress, 20, out)
    executor.run(_train, args=(str(progress), None, True, None, zero_stage))
    executor.shutdown()
    # of the 2 left: a step of the 3 that was under way at the kill may finish after it
    return _first_step_after(progress, out["killed_at"], size=2)


def _first_step_after(progress: Path, t0: float, size: int | None = None) -> float:
    return min(t for t, _, n in _steps(progress)
               if t > t0 + 1e-6 and (size is None or n == size)) - t0


def measure_checkpoint(tmp: Path) -> float:
    from raytrain_x import WorkerError
    from raytrain_x.ray import RayExecutor

    progress, ckpt = tmp / "ckpt.txt", tmp / "ckpt.pt"
    out: dict = {}
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=20), num_workers=3)
    executor.start()
    _kill_when(lambda: executor, progress, 20, out)
    try:
        executor.run(_train, args=(str(progress), str(ckpt), False))
    except WorkerError:
        pass
    executor.shutdown()
    restarted = RayExecutor(RayExecutor.create_settings(timeout_s=20), num_workers=3)
    restarted.start()
    restarted.run(_train, args=(str(progress), str(ckpt), False))
    restarted.shutdown()
    return _first_step_after(progress, out["killed_at"])


# ---------------------------------------------------------------------- nodes
WAIT_S = 120.0  # a wait for the cluster or the job to get somewhere


class _ElasticRun:
    """An elastic job (min 2 or 1, max 3) in a thread, training until told to stop."""

    def __init__(self, tmp: Path, min_workers: int) -> None:
        from raytrain_x.ray import RayExecutor

        self.progress, self.until = tmp / f"nodes-{time.time()}.txt", tmp / "stop"
        self.until.unlink(missing_ok=True)
        self.executor = RayExecutor(RayExecutor.create_settings(timeout_s=20),
                                    min_workers=min_workers, max_workers=3, cpus_per_worker=1)
        self.executor.start()
        self.results = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.started = time.time()
        self.thread.start()

    def _run(self) -> None:
        self.results = self.executor.run(
            _train, args=(str(self.progress), None, True, str(self.until)))

    def steps_at(self, size: int) -> int:
        return sum(1 for _, _, n in _steps(self.progress) if n == size)

    def finish(self) -> list:
        self.until.touch()
        self.thread.join(120)
        self.executor.shutdown()
        return self.results or []


def measure_grow(cluster, tmp: Path) -> float:
    """Head only: from the job's request to the autoscaler to its first step with 3."""
    wait_until(lambda: not cluster.worker_nodes(), WAIT_S, "idle nodes to be removed")
    run = _ElasticRun(tmp, min_workers=1)
    try:
        wait_until(lambda: run.steps_at(3) >= 1, WAIT_S, "the job to grow to 3 workers")
        asked = run.executor.last_elastic_job.capacity.requests[0][0]
        return _first_step_after(run.progress, asked, size=3)
    finally:
        run.finish()


def measure_node_loss(cluster, tmp: Path, how: str) -> tuple[float, int]:
    """3 workers on 3 nodes; the youngest worker's node drained or killed. Returns the
    seconds to the first step of the 2 left, and the restores the job did."""
    from raytrain_x.testing import drain_node, kill_node

    run = _ElasticRun(tmp, min_workers=2)
    try:
        # a drained or killed node of the measurement before stays in the provider's list
        # until the autoscaler finds it gone (AUTOSCALER_HEARTBEAT_TIMEOUT_S, 30 s) and
        # replaces it
        wait_until(lambda: run.steps_at(3) >= 5, 300, "5 steps with 3 workers")
        job = run.executor.last_elastic_job
        node = max(job.members.values(), key=lambda m: m.age).node
        t0 = time.time()
        if how == "drain":
            drain_node(cluster.address, node, deadline_s=60)
        else:
            kill_node(node)
        wait_until(lambda: any(t > t0 and n == 2 for t, _, n in _steps(run.progress)),
                   WAIT_S, f"a step without the {how}ed node")
        seconds = _first_step_after(run.progress, t0, size=2)
    finally:
        results = run.finish()
    return seconds, sum(r[1] for r in results)


def measure_node_checkpoint(cluster, tmp: Path) -> float:
    """RayExecutor(num_workers=3) on 3 nodes checkpointing every step; a node killed; the
    job restarts from the checkpoint on the 2 nodes left."""
    from raytrain_x import WorkerError
    from raytrain_x.ray import RayExecutor
    from raytrain_x.testing import kill_node

    progress, ckpt, until = tmp / "nodes-ckpt.txt", tmp / "nodes-ckpt.pt", tmp / "stop-ckpt"
    until.unlink(missing_ok=True)
    ckpt.unlink(missing_ok=True)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=20,
                                                       placement_group_timeout_s=300),
                           num_workers=3, cpus_per_worker=1)
    executor.start()
    out: dict = {}
    node = ray.get(executor.workers[-1].node_id.remote())  # busy actors answer no calls

    def kill() -> None:
        try:
            wait_until(lambda: sum(1 for _, _, n in _steps(progress) if n == 3) >= 5, WAIT_S,
                       "5 steps")
            out["killed_at"] = time.time()
            kill_node(node)
        finally:
            if "killed_at" not in out:  # end the job instead of training forever
                until.touch()

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    try:
        executor.run(_train, args=(str(progress), str(ckpt), False, str(until)))
    except WorkerError:
        pass
    executor.shutdown()
    killer.join(10)
    restarted = RayExecutor(RayExecutor.create_settings(timeout_s=20), num_workers=2,
                            cpus_per_worker=1)
    restarted.start()
    thread = threading.Thread(target=restarted.run, daemon=True,
                              args=(_train, (str(progress), str(ckpt), False, str(until))))
    thread.start()
    try:
        wait_until(lambda: any(t > out["killed_at"] and n == 2 for t, _, n in _steps(progress)),
                   WAIT_S, "the restarted job's first step")
    finally:
        until.touch()
        thread.join(60)
        restarted.shutdown()
    return _first_step_after(progress, out["killed_at"], size=2)


def measure_nodes(repeats: int) -> dict[str, list[float]]:
    from raytrain_x.testing import LocalAutoscalingCluster

    results: dict[str, list[float]] = {"grow": [], "drain": [], "drain_restores": [],
                                       "kill": [], "kill_restores": [], "checkpoint": []}
    types = {"cpu1": {"resources": {"CPU": 1}, "node_config": {}, "min_workers": 0,
                      "max_workers": 4}}
    with LocalAutoscalingCluster(types, {"CPU": 0}, idle_timeout_minutes=0.1,
                                 max_workers=4) as cluster:
        ray.init(address=cluster.address, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent)}})
        try:
            for i in range(repeats):
                with tempfile.TemporaryDirectory() as tmp:
                    results["grow"].append(measure_grow(cluster, Path(tmp)))
                    for how in ("drain", "kill"):
                        seconds, restores = measure_node_loss(cluster, Path(tmp), how)
                        results[how].append(seconds)
                        results[f"{how}_restores"].append(restores)
                    results["checkpoint"].append(measure_node_checkpoint(cluster, Path(tmp)))
                print(f"nodes, repeat {i + 1}/{repeats}: grow {results['grow'][-1]:.2f}s, "
                      f"drain {results['drain'][-1]:.2f}s "
                      f"({results['drain_restores'][-1]:g} restores), kill "
                      f"{results['kill'][-1]:.2f}s ({results['kill_restores'][-1]:g} "
                      f"restores), restart from checkpoint {results['checkpoint'][-1]:.2f}s",
                      flush=True)
        finally:
            ray.shutdown()
    return results


def _nodes_payload(nodes: dict[str, list[float]]) -> dict:
    medians = {k: statistics.median(v) for k, v in nodes.items()}
    print_table([{"3 workers on 3 nodes": k, "median s": medians[k]}
                 for k in ("grow", "drain", "kill", "checkpoint")],
                ["3 workers on 3 nodes", "median s"])
    ratios = {"drain_over_kill": medians["drain"] / medians["kill"],
              "kill_over_checkpoint": medians["kill"] / medians["checkpoint"]}
    print(f"drain / kill: {ratios['drain_over_kill']:.2f}x (restores: drain "
          f"{sum(nodes['drain_restores']):g}, kill {sum(nodes['kill_restores']):g}); "
          f"kill / restart from checkpoint: {ratios['kill_over_checkpoint']:.2f}x")
    return {"runs": nodes, "medians": medians, **ratios}


def _zero_recovery(args) -> None:
    """Recovery from a killed worker with the optimizer's state in every rank (stage 0) or
    sharded with a copy on a peer (stages 1 and 2), interleaved repeats."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent)}})
    runs: dict[str, list[float]] = {f"zero_stage={z}": [] for z in (0, 1, 2)}
    try:
        for i in range(args.repeats):
            for z in (0, 1, 2):
                with tempfile.TemporaryDirectory() as tmp:
                    runs[f"zero_stage={z}"].append(measure_elastic(Path(tmp), z))
            print(f"repeat {i + 1}/{args.repeats}: " + ", ".join(
                f"{k} {v[-1]:.2f}s" for k, v in runs.items()), flush=True)
    finally:
        ray.shutdown()
    medians = {k: statistics.median(v) for k, v in runs.items()}
    print_table([{"AdamW": k, "median s (kill -> first step)": v}
                 for k, v in medians.items()], ["AdamW", "median s (kill -> first step)"])
    ratios = {f"stage{z}_over_stage0": medians[f"zero_stage={z}"] / medians["zero_stage=0"]
              for z in (1, 2)}
    print(", ".join(f"{k}: {v:.2f}" for k, v in ratios.items()))
    payload = {"runs": runs, "medians": medians, **ratios}
    print(f"wrote {write_json('elastic_recovery_zero', payload, args.json)}")


# ---------------------------------------------------------------------- storage
def _model_and_optimizer(rx=None):
    import torch

    from raytrain_x.common.workloads import resnet50_parameter_shapes
    from raytrain_x.torch.workloads import shaped_model

    torch.set_num_threads(1)
    model = shaped_model(resnet50_parameter_shapes()[:60])  # ~3M parameters
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if rx is None:
        return model, inner
    return model, rx.DistributedOptimizer(inner, named_parameters=model.named_parameters())


def _lose_everything(rank: int, step: int, marks: str) -> None:
    """At step 20 of a job's first life every rank's process exits (rank 0 notes when);
    with a `.kill` mark, each rank says it is there and waits to be SIGKILLed from outside
    (`_kill_all`)."""
    if step != 20 or os.path.exists(f"{marks}.lost"):
        return
    if os.path.exists(f"{marks}.kill"):
        Path(f"{marks}.at20.{rank}").write_text(str(os.getpid()))
        time.sleep(120)  # killed long before
        os._exit(1)
    if rank == 0:
        Path(f"{marks}.lost").write_text(str(time.time()))
    else:
        wait_until(lambda: os.path.exists(f"{marks}.lost"), 30, "rank 0's mark")
    os._exit(1)


def _kill_all(marks: str, ranks: int) -> threading.Thread:
    """From the benchmark's process: once every rank waits at step 20, SIGKILLs them all
    and notes when."""
    import signal

    def kill() -> None:
        paths = [Path(f"{marks}.at20.{r}") for r in range(ranks)]
        wait_until(lambda: all(p.exists() and p.read_text() for p in paths), 300,
                   "every rank at step 20")
        for path in paths:
            os.kill(int(path.read_text()), signal.SIGKILL)
        Path(f"{marks}.lost").write_text(str(time.time()))

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def _durable_train(progress: str, marks: str) -> int:
    import torch

    import raytrain_x.torch as rx

    rx.init()
    model, opt = _model_and_optimizer(rx)
    state = rx.elastic.TorchState(model, opt, step=0)

    @rx.elastic.run
    def train(state):
        while state.step < 40:
            _lose_everything(rx.rank(), state.step, marks)
            opt.zero_grad()
            model(torch.ones(())).backward()
            opt.step()
            state.step += 1
            state.commit()
            if state.step == 20:  # the loss comes after a complete checkpoint, as Ray Train's
                state.checkpoint()
            if rx.rank() == 0:
                with open(progress, "a") as f:
                    f.write(f"{time.time()} {state.step} {rx.size()}\n")
        return state.step

    return train(state)


def _trainer_loop(config: dict) -> None:
    import ray.train
    import torch
    import torch.distributed as dist

    model, opt = _model_and_optimizer()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            saved = torch.load(os.path.join(folder, "state.pt"))
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        step = saved["step"]
    rank = dist.get_rank()
    while step < 40:
        _lose_everything(rank, step, config["marks"])
        opt.zero_grad()
        ddp(torch.ones(())).backward()
        opt.step()
        step += 1
        with tempfile.TemporaryDirectory() as folder:
            if rank == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "step": step}, os.path.join(folder, "state.pt"))
                with open(config["progress"], "a") as f:
                    f.write(f"{time.time()} {step} {dist.get_world_size()}\n")
                ray.train.report({"step": step},
                                 checkpoint=ray.train.Checkpoint.from_directory(folder))
            else:
                ray.train.report({"step": step})


def measure_storage(tmp: Path, way: str, s3: S3 | None = None) -> float:
    progress, marks = tmp / f"{way}.txt", str(tmp / f"{way}.marks")
    storage = s3.uri(tmp.name) if way == "durable_s3" and s3 is not None else \
        str(tmp / f"{way}-storage")
    if way.startswith("durable"):
        from raytrain_x import CheckpointConfig
        from raytrain_x.ray import RayExecutor

        if way != "durable":
            Path(f"{marks}.kill").touch()
            _kill_all(marks, 2)
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=20), min_workers=2,
                               max_workers=2, cpus_per_worker=1, cooldown_range=(0.1, 0.1),
                               checkpoint=CheckpointConfig(storage, name="job", every_s=1e9))
        executor.start()
        executor.run(_durable_train, args=(str(progress), marks))
        executor.shutdown()
    else:
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        TorchTrainer(_trainer_loop, torch_config=TorchConfig(backend="gloo"),
                     train_loop_config={"progress": str(progress), "marks": marks},
                     scaling_config=ScalingConfig(num_workers=2),
                     run_config=RunConfig(name="job", storage_path=storage,
                                          failure_config=FailureConfig(max_failures=1))).fit()
    lost = float(Path(f"{marks}.lost").read_text())
    return _first_step_after(progress, lost)


def _pid_then(pids: str, fn, *args):
    """Records this worker's process id in `pids`, then runs `fn`."""
    Path(pids, str(os.getpid())).touch()
    return fn(*args)


def _trainer_elastic_loop(config: dict):
    """The elastic job of `measure_elastic`, as `RaytrainXTrainer`'s loop."""
    return _pid_then(config["pids"], _train, config["progress"], None, True)


def measure_kill_by_pid(tmp: Path, way: str) -> float:
    """One worker of three SIGKILLed at step 20 (the youngest process); the time to the
    first step of the two left. `way`: "executor" (RayExecutor with min_workers=2,
    max_workers=3) or "trainer" (RaytrainXTrainer with ScalingConfig(num_workers=(2, 3)))."""
    import signal

    progress, pids = tmp / f"{way}.txt", tmp / f"{way}-pids"
    pids.mkdir()
    out: dict = {}

    def kill() -> None:
        while not any(s >= 20 for _, s, _ in _steps(progress)):
            time.sleep(0.02)
        out["killed_at"] = time.time()
        os.kill(max(int(p.name) for p in pids.iterdir()), signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    if way == "executor":
        from raytrain_x.ray import RayExecutor

        executor = RayExecutor(RayExecutor.create_settings(timeout_s=20), min_workers=2,
                               max_workers=3, cpus_per_worker=1)
        executor.start()
        try:
            executor.run(_pid_then, args=(str(pids), _train, str(progress), None, True))
        finally:
            executor.shutdown()
    else:
        from ray.train import FailureConfig, RunConfig, ScalingConfig

        from raytrain_x.ray.train import RaytrainXConfig, RaytrainXTrainer

        RaytrainXTrainer(
            _trainer_elastic_loop,
            train_loop_config={"pids": str(pids), "progress": str(progress)},
            raytrain_x_config=RaytrainXConfig(framework="torch", timeout_s=20),
            scaling_config=ScalingConfig(num_workers=(2, 3)),
            run_config=RunConfig(name=f"recovery-{time.monotonic_ns()}",
                                 storage_path=str(tmp / "storage"),
                                 failure_config=FailureConfig(max_failures=1))).fit()
    return _first_step_after(progress, out["killed_at"])


def _trainer_recovery(args) -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent)}})
    runs: dict[str, list[float]] = {"executor": [], "trainer": []}
    try:
        for i in range(args.repeats):
            for way in (runs if i % 2 == 0 else list(runs)[::-1]):
                with tempfile.TemporaryDirectory() as tmp:
                    runs[way].append(measure_kill_by_pid(Path(tmp), way))
            print(f"repeat {i + 1}/{args.repeats}: " + ", ".join(
                f"{way} {values[-1]:.2f}s" for way, values in runs.items()), flush=True)
    finally:
        ray.shutdown()
    medians = _print_medians(runs, "a worker killed", "median s (kill -> first step)")
    ratio = medians["trainer"] / medians["executor"]
    print(f"trainer / RayExecutor: {ratio:.2f}x")
    payload = {"runs": runs, "medians": medians, "trainer_over_executor": ratio}
    print(f"wrote {write_json('elastic_recovery_trainer', payload, args.json)}")


def _print_medians(runs: dict[str, list[float]], way: str, value: str) -> dict[str, float]:
    """Each way's median, printed as a table of two columns named `way` and `value`."""
    medians = {k: statistics.median(v) for k, v in runs.items()}
    print_table([{way: k, value: v} for k, v in medians.items()], [way, value])
    return medians


class S3:
    """moto's S3 server on loopback, in this process (the workers get its keys)."""

    KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}

    def __init__(self) -> None:
        import logging

        from moto.server import ThreadedMotoServer

        from raytrain_x.testing.waiting import free_port

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port,
                                         verbose=False)
        self.server.start()
        os.environ.update(self.KEYS)

    def uri(self, bucket: str) -> str:
        return (f"s3://{bucket.lower().replace('_', '-')}/runs?endpoint_override="
                f"127.0.0.1:{self.port}&scheme=http&allow_bucket_creation=true")


def _storage_recovery(args) -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    s3 = S3()
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent),
                                       **S3.KEYS}})
    runs: dict[str, list[float]] = {"durable": [], "durable_killed": [], "durable_s3": [],
                                    "torch_trainer": []}
    try:
        for i in range(args.repeats):
            for way in (runs if i % 2 == 0 else list(runs)[::-1]):
                with tempfile.TemporaryDirectory() as tmp:
                    runs[way].append(measure_storage(Path(tmp), way, s3))
            print(f"repeat {i + 1}/{args.repeats}: " + ", ".join(
                f"{way} {values[-1]:.2f}s" for way, values in runs.items()), flush=True)
    finally:
        ray.shutdown()
        s3.server.stop()
    medians = _print_medians(runs, "whole job lost", "median s (loss -> first step)")
    ratio = medians["durable"] / medians["torch_trainer"]
    ratios = {f"{way}_over_torch_trainer": medians[way] / medians["torch_trainer"]
              for way in ("durable_killed", "durable_s3")}
    print(f"durable / TorchTrainer: {ratio:.2f}x; " +
          ", ".join(f"{k}: {v:.2f}x" for k, v in ratios.items()))
    payload = {"runs": runs, "medians": medians, "durable_over_torch_trainer": ratio,
               **ratios}
    print(f"wrote {write_json('elastic_recovery_storage', payload, args.json)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-nodes", dest="nodes", action="store_false",
                        help="skip the node measurements on a local autoscaling cluster")
    parser.add_argument("--nodes-only", action="store_true",
                        help="only the node measurements")
    parser.add_argument("--zero", action="store_true",
                        help="only the elastic recovery with AdamW unsharded and sharded "
                             "(zero_stage 0, 1, 2)")
    parser.add_argument("--storage", action="store_true",
                        help="only the whole job lost: durable checkpoints against Ray "
                             "Train's TorchTrainer restarting from its checkpoint")
    parser.add_argument("--trainer", action="store_true",
                        help="only a worker killed under the elastic RaytrainXTrainer against "
                             "RayExecutor (both by SIGKILL)")
    parser.add_argument("--discovery", action="store_true",
                        help="only a discovery script's hosts added and removed under the "
                             "job (benchmarks/elastic_discovery.py)")
    args = parser.parse_args()
    if args.discovery:
        import elastic_discovery

        elastic_discovery.run(args.repeats, args.json)
        return
    if args.storage:
        _storage_recovery(args)
        return
    if args.trainer:
        _trainer_recovery(args)
        return
    if args.zero:
        _zero_recovery(args)
        return
    if args.nodes_only:
        nodes = measure_nodes(args.repeats)
        print(f"wrote {write_json('elastic_recovery_nodes', _nodes_payload(nodes), args.json)}")
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent)}})
    results: dict[str, list[float]] = {"elastic": [], "checkpoint": []}
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            results["elastic"].append(measure_elastic(Path(tmp)))
            results["checkpoint"].append(measure_checkpoint(Path(tmp)))
        print(f"repeat {i + 1}/{args.repeats}: elastic {results['elastic'][-1]:.2f}s, "
              f"restart from checkpoint {results['checkpoint'][-1]:.2f}s", flush=True)
    medians = _print_medians(results, "recovery", "median s (kill -> first step)")
    ratio = medians["checkpoint"] / medians["elastic"]
    print(f"restart-from-checkpoint / elastic: {ratio:.1f}x")
    payload = {"runs": results, "medians": medians, "checkpoint_over_elastic": ratio}
    ray.shutdown()
    if args.nodes:
        payload["nodes"] = _nodes_payload(measure_nodes(args.repeats))
    print(f"wrote {write_json('elastic_recovery', payload, args.json)}")


if __name__ == "__main__":
    main()
