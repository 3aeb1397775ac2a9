"""Ray Train v2: `RaytrainXTrainer` (raytrain-x's `DistributedOptimizer`) against Ray Train's
own `TorchTrainer` (DDP over gloo), the same training loop on the same workers; and the
elastic trainer (`ScalingConfig(num_workers=(W, W))`, the loop committing a `TorchState`
every step, as an elastic loop does) against the fixed one, with no faults.

Workloads (`raytrain_x.torch.workloads`, as in real_networks.py): ResNet-18 on 64x64 images
(SGD with momentum, 32 images per worker) and the GPT-style decoder (AdamW, 4 sequences of
128 tokens per worker). Each round fits both trainers, one after the other, on a fresh
worker group each (what a Ray Train user gets); inside the loop, after --warmup untimed
steps, --steps steps are timed on every worker and the slowest worker's time counts.
Reported: samples/s (median over rounds, spread), the ratio to `TorchTrainer` (and the
elastic trainer's to the fixed `RaytrainXTrainer`), and each
fit's wall time (worker group start, world formation, training, shutdown). With both
raytrain-x trainers, also the elastic trainer's rate over the fixed one's within each round
(the two fits run back to back) and their median: the machine's speed drifts between rounds
more than the two trainers differ; the same from each fit's median step (each step timed on
the slower rank), which leaves out the steps another process on the machine interrupted.

Run alone: .venv/bin/python benchmarks/ray_train_vs_torch_trainer.py [--repeats 3]
Writes results/ray_train_vs_torch_trainer.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from common import print_table, write_json

BATCH = {"resnet18": 32, "gpt": 4}
WAYS = ("torch_trainer", "raytrain_x", "raytrain_x_elastic")


def _loop(config: dict) -> None:
    import statistics

    import ray.train
    import torch

    from raytrain_x.torch import workloads

    torch.set_num_threads(1)
    name, way, batch = config["workload"], config["way"], BATCH[config["workload"]]
    torch.manual_seed(0)
    if name == "resnet18":
        model = workloads.resnet18()
        opt = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9)

        def data(step: int):
            return workloads.synthetic_images(batch, seed=step)

        loss_fn = torch.nn.functional.cross_entropy
    else:
        model = workloads.GPTDecoder()
        opt = torch.optim.AdamW(model.parameters(), 3e-4)

        def data(step: int):
            return workloads.synthetic_tokens(batch, seq=128, seed=step)

        def loss_fn(logits, targets):
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    commit = None
    if way.startswith("raytrain_x"):
        import raytrain_x.torch as rx

        rx.init()
        opt = rx.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        rx.broadcast_parameters(model.state_dict(), root_rank=0)

        def slowest_each(seconds: list[float], name: str = "each") -> list[float]:
            return rx.allreduce(torch.tensor(seconds), op=rx.Max, name=name).tolist()

        if way == "raytrain_x_elastic" and config["commit_every"]:  # an elastic loop's commits
            commit = rx.elastic.TorchState(model, opt, step=0).commit
    else:
        import torch.distributed as dist

        model = ray.train.torch.prepare_model(model)  # DistributedDataParallel

        def slowest_each(seconds: list[float], name: str = "each") -> list[float]:
            t = torch.tensor(seconds)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t.tolist()

    def slowest(seconds: float) -> float:
        return slowest_each([seconds], name="slowest")[0]

    def step(i: int) -> None:
        x, y = data(i)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        if commit is not None and i % config["commit_every"] == 0:
            commit()

    for i in range(config["warmup"]):
        step(i)
    slowest(0.0)  # a barrier
    began = time.perf_counter()
    ends = []
    for i in range(config["steps"]):
        step(config["warmup"] + i)
        ends.append(time.perf_counter())
    seconds = slowest((ends[-1] - began) / config["steps"])
    # each step's time on the slower rank; their median leaves out the steps another
    # process on the machine interrupted
    each = slowest_each([b - a for a, b in zip([began, *ends], ends)])
    context = ray.train.get_context()
    samples = batch * context.get_world_size()
    metrics = {"samples_per_s": samples / seconds, "step_s": seconds,
               "median_step_samples_per_s": samples / statistics.median(each)}
    if context.get_world_rank() != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as folder:  # Ray Train v2 keeps metrics with a checkpoint
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))


def fit(way: str, name: str, args, storage: str) -> tuple[float, float]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from raytrain_x.ray.train import RaytrainXConfig, RaytrainXTrainer

    config = {"workload": name, "way": way, "warmup": args.warmup, "steps": args.steps,
              "commit_every": args.commit_every}
    workers = (args.workers, args.workers) if way == "raytrain_x_elastic" else args.workers
    common = {"train_loop_config": config,
              "scaling_config": ScalingConfig(num_workers=workers),
              "run_config": RunConfig(name=f"{name}-{way}-{time.monotonic_ns()}",
                                      storage_path=storage)}
    began = time.monotonic()
    if way.startswith("raytrain_x"):
        trainer = RaytrainXTrainer(_loop, raytrain_x_config=RaytrainXConfig(framework="torch"),
                                   **common)
    else:
        trainer = TorchTrainer(_loop, torch_config=TorchConfig(backend="gloo"), **common)
    result = trainer.fit()
    return (result.metrics["samples_per_s"], result.metrics["median_step_samples_per_s"],
            time.monotonic() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["resnet18", "gpt"],
                        choices=sorted(BATCH))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--commit-every", type=int, default=1,
                        help="the elastic trainer's loop commits every this many steps (0: never)")
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import ray

    ray.init(num_cpus=args.workers + 1, include_dashboard=False, log_to_driver=False)
    started = time.monotonic()
    ways = tuple(args.ways)
    rates = {n: {w: [] for w in ways} for n in args.workloads}
    median_rates = {n: {w: [] for w in ways} for n in args.workloads}
    walls = {n: {w: [] for w in ways} for n in args.workloads}
    try:
        with tempfile.TemporaryDirectory(prefix="rtx_bench_") as storage:
            for r in range(args.repeats):
                for name in args.workloads:
                    for way in (ways if r % 2 == 0 else ways[::-1]):  # alternate who goes first
                        rate, median_rate, wall = fit(way, name, args, storage)
                        rates[name][way].append(rate)
                        median_rates[name][way].append(median_rate)
                        walls[name][way].append(wall)
                        print(f"round {r + 1}/{args.repeats} {name} {way}: {rate:.1f} "
                              f"samples/s ({median_rate:.1f} at the median step), fit "
                              f"{wall:.1f}s", flush=True)
    finally:
        ray.shutdown()
    rows = []
    paired = {}  # the elastic trainer's rate over the fixed one's in the same round
    for name, ways in rates.items():
        for kind, of in (("mean", ways), ("median step", median_rates[name])):
            if "raytrain_x" in of and "raytrain_x_elastic" in of:
                paired.setdefault(name, {})[kind] = [
                    e / f for e, f in zip(of["raytrain_x_elastic"], of["raytrain_x"])]
        med = {w: statistics.median(v) for w, v in ways.items()}
        for way, values in ways.items():
            rows.append({"workload": name, "trainer": way, "samples/s": med[way],
                         "min": min(values), "max": max(values),
                         "spread %": 100 * (max(values) - min(values)) / med[way],
                         "vs TorchTrainer": med[way] / med["torch_trainer"]
                         if "torch_trainer" in med else None,
                         "vs fixed": med[way] / med["raytrain_x"] if "raytrain_x" in med
                         else None,
                         "fit s": statistics.median(walls[name][way])})
    print_table(rows, ["workload", "trainer", "samples/s", "min", "max", "spread %",
                       "vs TorchTrainer", "vs fixed", "fit s"])
    for name, kinds in paired.items():  # steadier than a ratio of medians across rounds
        for kind, ratios in kinds.items():
            print(f"{name}: elastic / fixed in the same round, {kind}: median "
                  f"{statistics.median(ratios):.3f} (rounds: "
                  f"{', '.join(f'{r:.3f}' for r in ratios)})")
    path = write_json("ray_train_vs_torch_trainer", {
        "workers": args.workers, "repeats": args.repeats, "warmup": args.warmup,
        "commit_every": args.commit_every,
        "steps": args.steps, "batch_per_worker": BATCH, "samples_per_s": rates,
        "median_step_samples_per_s": median_rates,
        "fit_seconds": walls, "rows": rows, "elastic_over_fixed_per_round": paired,
        "seconds": round(time.monotonic() - started, 1)}, args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
