"""Autotune vs an exhaustive grid on the ResNet-50-shaped gradient workload, 2 processes.

In the same processes: autotune (fusion threshold x cycle time, BayesOptSearch) runs
first, then every grid point is measured the same way, then the top 3 grid points, the
tuned and the default knobs are measured again in interleaved rounds (medians; the
grid's single best number is the luckiest of 36 and would flatter the grid). Reports how
many samples autotune needed to get within 5% of the grid best, and the tuned knobs' ratio
to the grid best and to the defaults. The workload sends every gradient as its own
request (`--bucket-cap-mb 0`), so the engine's knobs decide how they batch.
Writes results/autotune_quality.json and results/autotune_quality.png.

Run: .venv/bin/python benchmarks/autotune_quality.py [--quick]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, join_world, print_table, run_ranks, write_json  # noqa: E402

FUSION_MB = [0, 1, 4, 16, 64, 256]
CYCLE_MS = [0.2, 1.0, 2.5, 5.0, 10.0, 25.0]


def _worker(rank: int, size: int, port: int, args, queue) -> None:
    import raytrain_x.torch as rx
    from raytrain_x import Knobs
    from raytrain_x.common.autotune_config import AutotuneConfig
    from raytrain_x.common.workloads import resnet50_parameter_shapes, shaped_model
    from raytrain_x.fusion import runtime

    # the grid covers fusion x cycle time; the other knobs stay fixed
    join_world(rank, size, port, {"RAYTRAIN_X_CACHE_CAPACITY": "1024",
                                  "RAYTRAIN_X_HIERARCHICAL_ALLREDUCE": "0",
                                  "RAYTRAIN_X_HIERARCHICAL_ALLGATHER": "0",
                                  "RAYTRAIN_X_SHM": "1" if args.transport == "shm" else "0"})
    config = AutotuneConfig(log_file=args.log)  # the defaults users get: 3 warmup samples,
    # 10 steps per sample, at most 20 samples, convergence after 8 without a gain
    rx.init(autotune=config)
    model = shaped_model(resnet50_parameter_shapes())
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-5),
                                  named_parameters=model.named_parameters(),
                                  bucket_cap_mb=args.bucket_cap_mb)
    grad_bytes = sum(p.numel() for p in model.parameters()) * 4
    scale = torch.ones(())

    def step() -> None:
        opt.zero_grad()
        model(scale).backward()
        opt.step()

    def measure(knobs: Knobs, steps: int) -> float:
        if rank == 0:
            rx.set_knobs(knobs)
        step()
        step()  # the switch lands within these
        start = time.perf_counter()
        for _ in range(steps):
            step()
        return grad_bytes * steps / (time.perf_counter() - start)

    tuning_steps = 0
    while True:
        step()
        tuning_steps += 1
        if tuning_steps % 3 == 0:
            sampler = runtime.autotune_sampler()
            done = torch.tensor([1.0 if sampler is None or sampler.done else 0.0])
            if rx.allreduce(done, op=rx.Min, name=f"done{tuning_steps}").item() == 1.0:
                break
    tuned = rx.knobs()
    grid = []
    for mb in args.fusion_mb:
        for cycle in args.cycle_ms:
            knobs = Knobs(fusion_threshold_bytes=int(mb * 2**20), cycle_time_ms=cycle)
            grid.append((mb, cycle, measure(knobs, args.steps)))
            if rank == 0:
                print(f"grid fusion {mb} MB, cycle {cycle} ms: {grid[-1][2] / 1e6:.1f} MB/s",
                      flush=True)
    # The grid's maximum is biased upwards (the luckiest of 36 noisy numbers), so the top
    # 3 grid points, the tuned and the default knobs are measured again, interleaved, and
    # compared by their medians.
    top = sorted(grid, key=lambda g: g[2], reverse=True)[:3]
    finalists = {f"grid {mb:g} MB / {cycle:g} ms": Knobs(fusion_threshold_bytes=int(mb * 2**20),
                                                         cycle_time_ms=cycle)
                 for mb, cycle, _ in top}
    finalists.update({"tuned": tuned, "default": Knobs()})
    rounds: dict[str, list[float]] = {name: [] for name in finalists}
    for _ in range(args.rounds):
        for name, knobs in finalists.items():
            rounds[name].append(measure(knobs, 2 * args.steps))
    final = {name: statistics.median(v) for name, v in rounds.items()}
    rx.shutdown()
    if rank == 0:
        queue.put({"grid": grid, "final": final, "rounds": rounds, "tuned": tuned.to_dict(),
                   "tuning_steps": tuning_steps})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per grid point")
    parser.add_argument("--quick", action="store_true", help="fewer grid points")
    parser.add_argument("--transport", choices=["shm", "gloo"], default="shm",
                        help="gloo: as between hosts, where every unfused tensor is a network "
                        "round trip")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved re-measurements of the finalists")
    parser.add_argument("--bucket-cap-mb", type=float, default=0.0,
                        help="DistributedOptimizer buckets; 0 (default) sends every gradient "
                        "as its own request, so fusion and cycle time decide the batching")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.fusion_mb = [0, 4, 64] if args.quick else FUSION_MB
    args.cycle_ms = [1.0, 10.0] if args.quick else CYCLE_MS
    suffix = "" if args.transport == "shm" else "_gloo"
    args.log = str(RESULTS_DIR / f"autotune_quality{suffix}_log.csv")
    RESULTS_DIR.mkdir(exist_ok=True)
    out = run_ranks(_worker, 2, args)

    final = out["final"]
    grid_names = [k for k in final if k.startswith("grid")]
    best_name = max(grid_names, key=lambda k: final[k])
    grid_best = final[best_name]  # re-measured: the best of the top 3 grid points
    rows = list(csv.DictReader(open(args.log)))
    samples = [r for r in rows if r["kind"] in ("sample", "confirm")]
    within = next((i + 1 for i, r in enumerate(samples)
                   if float(r["score_bytes_per_s"]) >= 0.95 * grid_best), None)
    result = {
        "workload": f"DistributedOptimizer, bucket_cap_mb={args.bucket_cap_mb:g}",
        "transport": args.transport,
        "grid_points": len(out["grid"]),
        "grid_best_single_mb_s": max(score for _, _, score in out["grid"]) / 1e6,
        "grid_best_mb_s": grid_best / 1e6,
        "grid_best": best_name,
        "autotune_samples": len(samples),
        "samples_to_within_5pct_of_grid_best": within,
        "tuned_knobs": out["tuned"],
        "tuned_mb_s": final["tuned"] / 1e6,
        "default_mb_s": final["default"] / 1e6,
        "tuned_over_grid_best": final["tuned"] / grid_best,
        "tuned_over_default": final["tuned"] / final["default"],
        "final_rounds_mb_s": {k: [x / 1e6 for x in v] for k, v in out["rounds"].items()},
    }
    print_table([{"what": k, "value": v} for k, v in result.items()
                 if not isinstance(v, dict)], ["what", "value"])
    print(f"grid best {best_name}, tuned {out['tuned']}")
    _plot(out["grid"], samples, grid_best, final, RESULTS_DIR / f"autotune_quality{suffix}.png")
    path = write_json("autotune_quality" + suffix, {**result, "grid": out["grid"]}, args.json)
    print(f"wrote {path}")


def _plot(grid, samples, grid_best, final, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scores = [float(r["score_bytes_per_s"]) / 1e6 for r in samples]
    index = range(1, len(scores) + 1)
    best_so_far = [max(scores[: i + 1]) for i in range(len(scores))]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for kind, marker, label in (("sample", "o", "autotune sample"),
                                ("confirm", "s", "leader measured again")):
        points = [(i, v) for i, v, r in zip(index, scores, samples) if r["kind"] == kind]
        if points:
            ax.plot(*zip(*points), marker, label=label)
    ax.step(index, best_so_far, where="post", label="best single sample so far")
    ax.axhline(grid_best / 1e6, color="green", linestyle="--",
               label=f"grid best ({len(grid)} points, re-measured)")
    ax.axhline(0.95 * grid_best / 1e6, color="green", linestyle=":", label="95% of grid best")
    ax.axhline(final["tuned"] / 1e6, color="tab:red", linestyle="-.",
               label="tuned knobs, re-measured")
    ax.axhline(final["default"] / 1e6, color="gray", linestyle=":",
               label="default knobs, re-measured")
    ax.set_xlabel("autotune sample")
    ax.set_ylabel("gradient MB/s")
    ax.set_title("autotune vs exhaustive grid (ResNet-50-shaped, 2 workers)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
