"""Time from a worker kill to the first completed training step after recovery.

Same job, same run, two ways:
  elastic      RayExecutor(min_workers=2, max_workers=3): survivors restore the last
               in-memory commit and go on in a new rendezvous round
  checkpoint   RayExecutor(num_workers=3) saving a checkpoint every step; after the kill
               the job is started again and resumes from the checkpoint (Ray Train's way)
Writes results/elastic_recovery.json.

Run: .venv/bin/python benchmarks/elastic_recovery.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

STEPS = 60


def _train(progress: str, checkpoint: str | None, elastic: bool) -> int:
    import torch

    import raytrain_x.torch as rx
    from raytrain_x.common.workloads import resnet50_parameter_shapes
    from raytrain_x.torch.workloads import shaped_model

    rx.init()
    torch.set_num_threads(1)
    model = shaped_model(resnet50_parameter_shapes()[:60])  # ~3M parameters
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                  named_parameters=model.named_parameters())
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
                f.write(f"{time.time()} {step}\n")

    if elastic:
        state = rx.elastic.TorchState(model, opt, step=0)

        @rx.elastic.run
        def train(state):
            while state.step < STEPS:
                one_step(state.step)
                state.step += 1
                state.commit()
            return state.step

        return train(state)
    for step in range(step0, STEPS):
        one_step(step)
        if rx.rank() == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "step": step + 1}, checkpoint)
        rx.barrier()
    return STEPS


def _steps(progress: Path) -> list[tuple[float, int]]:
    if not progress.exists():
        return []
    return [(float(t), int(s)) for t, s in
            (line.split() for line in progress.read_text().splitlines() if line.strip())]


def _kill_when(executor_ref, progress: Path, at_step: int, out: dict) -> threading.Thread:
    def run():
        while not any(s >= at_step for _, s in _steps(progress)):
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


def measure_elastic(tmp: Path) -> float:
    from raytrain_x.ray import RayExecutor

    progress = tmp / "elastic.txt"
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=20), min_workers=2,
                           max_workers=3, cpus_per_worker=1)
    executor.start()
    out: dict = {}
    _kill_when(lambda: executor, progress, 20, out)
    executor.run(_train, args=(str(progress), None, True))
    executor.shutdown()
    return min(t for t, _ in _steps(progress) if t > out["killed_at"] + 1e-6) - out["killed_at"]


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
    return min(t for t, _ in _steps(progress) if t > out["killed_at"] + 1e-6) - out["killed_at"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
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
    medians = {k: statistics.median(v) for k, v in results.items()}
    print_table([{"recovery": k, "median s (kill -> first step)": v}
                 for k, v in medians.items()], ["recovery", "median s (kill -> first step)"])
    ratio = medians["checkpoint"] / medians["elastic"]
    print(f"restart-from-checkpoint / elastic: {ratio:.1f}x")
    payload = {"runs": results, "medians": medians, "checkpoint_over_elastic": ratio}
    print(f"wrote {write_json('elastic_recovery', payload, args.json)}")


if __name__ == "__main__":
    main()
