"""A straggler: one of 3 elastic workers twice as slow, with and without `SlowWorkers`.

A local Ray cluster of one node; an elastic `RayExecutor(min_workers=2, max_workers=3)`
trains an MLP on synthetic data (one thread per worker, --batch samples each per step,
`TorchState` committed every step) for --seconds of wall time, twice: with
`policies=[SlowWorkers()]` and with none. The first worker to start is slowed on purpose:
each step it sleeps as long as its own forward and backward took, so its work per step
doubles. Rank 0 logs every step's time and world size; the job's samples/s is the samples
its steps trained (world size x batch each) over the wall time from its first step.

Reports both ways' samples/s and their ratio (the target: >= 1.3x with the policy), when
the slowed worker left, and writes results/slow_workers.json and a plot of samples/s over
time, results/slow_workers.png.

Run alone: .venv/bin/python benchmarks/slow_workers.py [--seconds 60] [--batch 512] [--width 1024]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from common import RESULTS_DIR, print_table, say, write_json


def _train(cfg: dict, claim: str) -> dict:
    """In each worker: trains until rank 0's clock passes cfg["seconds"] from the first
    step; returns rank 0's step log [(seconds since the first step, world size)]."""
    import torch

    import raytrain_x.torch as rx

    try:
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL))
        slowed = True
    except FileExistsError:
        slowed = False
    torch.set_num_threads(1)
    rx.init()
    torch.manual_seed(0)
    width = cfg["width"]
    model = torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 10))
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters())
    state = rx.elastic.TorchState(model, opt, step=0, began=0.0, log=[])
    g = torch.Generator().manual_seed(rx.rank())
    x = torch.randn(cfg["batch"], 256, generator=g)
    y = torch.randint(0, 10, (cfg["batch"],), generator=g)

    @rx.elastic.run
    def train(state):
        while True:
            now = time.time()
            if state.began == 0.0:
                state.began = now
            done = torch.tensor([float(now - state.began >= cfg["seconds"])])
            if rx.broadcast(done, root_rank=0, name="slow.done").item():
                return {"log": state.log, "slowed": slowed}
            began = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if slowed:  # its work per step, doubled
                time.sleep(time.perf_counter() - began)
            opt.step()
            state.step += 1
            state.log = [*state.log, (time.time() - state.began, rx.size())]
            state.commit()

    return train(state)


def _run(cfg: dict, policies: list) -> dict:
    from raytrain_x.ray import RayExecutor

    claim = tempfile.mktemp(prefix="slow_workers_", dir="/tmp")
    executor = RayExecutor(min_workers=2, max_workers=3, cpus_per_worker=1,
                           cooldown_range=(600, 600), policies=policies)
    executor.start()
    try:
        results = executor.run(_train, args=[cfg, claim])
        events = [(round(e.time, 2), e.kind, e.detail.get("reason", ""))
                  for e in executor.last_elastic_job.events
                  if e.kind in ("asked_to_leave", "round", "failure")]
    finally:
        executor.shutdown()
        Path(claim).unlink(missing_ok=True)
    log = next(r["log"] for r in results if r["log"])
    samples = sum(size * cfg["batch"] for _, size in log)
    return {"samples_per_s": samples / log[-1][0], "steps": len(log), "log": log,
            "events": events, "finished": len(results),
            "left_at_s": next((t for t, s in log if s == 2), None)}


def _plot(raw: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    batch = raw["config"]["batch"]
    for way, color in (("with SlowWorkers", "#dd8452"), ("no policy", "#999")):
        log = raw[way]["log"]
        edges = range(0, int(log[-1][0]) - 1, 2)  # whole windows
        rates = [sum(size * batch for t, size in log if e <= t < e + 2) / 2 for e in edges]
        ax.plot(list(edges), rates, label=f"{way}: {raw[way]['samples_per_s']:.0f} samples/s",
                color=color)
    ax.set_xlabel("seconds from the first step")
    ax.set_ylabel("samples/s (2 s windows)")
    ax.set_title("3 elastic workers, one twice as slow")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    cfg = {"seconds": args.seconds, "batch": args.batch, "width": args.width}
    import ray

    from raytrain_x.ray import SlowWorkers

    began = time.monotonic()
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).parent)}})
    raw: dict = {"config": cfg}
    try:
        for way, policies in (("with SlowWorkers", [SlowWorkers()]), ("no policy", [])):
            raw[way] = _run(cfg, policies)
            say(f"{way}: {raw[way]['samples_per_s']:.0f} samples/s over {raw[way]['steps']} "
                f"steps; the slowed worker left at "
                f"{raw[way]['left_at_s'] if raw[way]['left_at_s'] is not None else '-'} s")
    finally:
        ray.shutdown()
    with_, without = raw["with SlowWorkers"], raw["no policy"]
    raw["ratio"] = with_["samples_per_s"] / without["samples_per_s"]
    rows = [{"way": w, "samples/s": raw[w]["samples_per_s"], "steps": raw[w]["steps"],
             "left at s": raw[w]["left_at_s"] if raw[w]["left_at_s"] is not None else "-",
             "x no policy": raw[w]["samples_per_s"] / without["samples_per_s"]}
            for w in ("with SlowWorkers", "no policy")]
    print_table(rows, ["way", "samples/s", "steps", "left at s", "x no policy"])
    raw["rows"] = rows
    raw["seconds"] = round(time.monotonic() - began, 1)
    path = write_json("slow_workers", raw)
    _plot(raw, RESULTS_DIR / "slow_workers.png")
    print(f"wrote {path} and {RESULTS_DIR / 'slow_workers.png'} ({raw['seconds']:.0f}s)")


if __name__ == "__main__":
    main()
