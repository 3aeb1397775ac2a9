"""Throughput of networks whose backward computes: one host, and an emulated cluster.

Workloads (`raytrain_x.torch.workloads`, plain torch, synthetic deterministic data):
  resnet18   ResNet-18 (11.2M parameters, 45 MB of gradients) on 64x64 images, SGD
             with momentum
  gpt        a GPT-style decoder (6 layers, width 512, sequence 128, 23.2M parameters,
             93 MB of gradients), AdamW
Ways, in the same processes, interleaved round by round (--repeats rounds):
  solo       rank 0 trains alone while the others wait (one worker's throughput)
  floor      every worker trains on its own at once (no communication): the compute floor
  ddp<N>     DistributedDataParallel with bucket_cap_mb=N (25 is DDP's default)
  rx         raytrain_x.torch.DistributedOptimizer as the README calls it
  rx-flat    the same with hierarchical allreduce off (on by default), in worlds of
             several hosts with several workers each (where it applies)
  rx-b<N>    the same with bucket_cap_mb=N fixed (0: every gradient goes on its own and the
             engine fuses what is ready in each cycle, Horovod's way); --rx-buckets
  rx-t<M>c<C>  the default path at fusion threshold M MB and cycle time C ms (--grid-mb
             and --grid-ms: the landscape autotune searches)
  rx-tuned   the default path at the knobs autotune chose for this workload in this world
             (--autotune: tuned first, with the settings users get; the log is kept)
  rx-serial  one bucket for every gradient, reduced after backward ends: nothing overlaps
             (the reference the hidden share is measured against)
  rx-metrics rx with the job's metrics exported as a Ray worker exports them
             (`raytrain_x.ray.metrics`), every --metrics-interval seconds, during its timed
             steps (--metrics-cost; rx beside it runs without): what metrics cost a step
Reports, per way: samples/s (median over rounds, min-max), against the floor, DDP's
default and DDP's best bucket; scaling efficiency (samples/s over workers x solo); and the
share of communication hidden behind backward, 1 - (t - t_floor) / (t_serial - t_floor)
with t the seconds per step. Writes results/real_networks[_<where>].json and a plot.

Where:
  --hosts 1 (default)   --workers ranks as processes on this machine
  --hosts 2             an emulated cluster (network namespaces, one Ray node per host,
                        `tc tbf` links of --link-gbit): RayExecutor with 1 and 2 workers
                        per host (--per-host). Needs root.

Run alone: .venv/bin/python benchmarks/real_networks.py [--hosts 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from common import (
    RESULTS_DIR,
    add_place_arguments,
    agree_knobs,
    autotune_knobs,
    drive_worlds,
    emulated_world,
    hierarchical_of,
    join_world,
    median_across_ranks,
    multi_level_world,
    other_hierarchy_way,
    print_table,
    rss_mib,
    run_emulated,
    run_ranks,
    say,
    write_json,
)

BATCH = {"resnet18": 32, "gpt": 4}  # per worker: a step of 0.2-2 s on this machine
DEFAULT_FUSION = {"fusion_threshold_bytes": 64 << 20, "cycle_time_ms": 1.0}  # Knobs()
SERIAL_MB = 4096.0  # a bucket larger than any workload: one collective after backward


def _workload(name: str):
    from raytrain_x.torch.workloads import (
        GPTDecoder,
        resnet18,
        synthetic_images,
        synthetic_tokens,
    )

    batch = BATCH[name]
    if name == "resnet18":
        def data(rank: int, step: int):
            return synthetic_images(batch, seed=1000 * rank + step)

        return (resnet18, lambda m: torch.optim.SGD(m.parameters(), 0.05, momentum=0.9),
                data, torch.nn.functional.cross_entropy)

    def tokens(rank: int, step: int):
        return synthetic_tokens(batch, seq=128, seed=1000 * rank + step)

    def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return (GPTDecoder, lambda m: torch.optim.AdamW(m.parameters(), 3e-4), tokens, lm_loss)


def tune(name: str, args, tag: str) -> dict:
    """Autotune with the settings users get, on `name`, in this world; returns the chosen
    knobs. The world is made again without autotune afterwards."""
    import torch.distributed as dist

    import raytrain_x.torch as rx

    rank = dist.get_rank()
    make_model, make_opt, data, loss_fn = _workload(name)

    def make_step():
        model = make_model()
        opt = rx.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters())
        counter = iter(range(1 << 30))

        def step() -> None:
            x, y = data(rank, next(counter))
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        return step

    return autotune_knobs(make_step, RESULTS_DIR / f"{tag}_{name}_autotune.csv", BATCH[name],
                          name)


def ways_of(args, hierarchical: bool) -> list[str]:
    ways = ["solo", "floor", *(f"ddp{b:g}" for b in args.ddp_buckets), "rx",
            *(f"rx-b{b:g}" for b in args.rx_buckets),
            *(f"rx-t{mb:g}c{ms:g}" for mb in args.grid_mb for ms in args.grid_ms
              if (mb * 2**20, ms) != (DEFAULT_FUSION["fusion_threshold_bytes"],
                                      DEFAULT_FUSION["cycle_time_ms"]))]  # that one is rx
    if hierarchical:
        ways.append(other_hierarchy_way())
    if args.metrics_cost:
        ways.append("rx-metrics")
    return ways + ["rx-serial"]


def _ways_for(name: str, args, hierarchical: bool) -> list[str]:
    ways = ways_of(args, hierarchical)
    return ways + ["rx-tuned"] if name in args.autotune else ways


def measure(args, hierarchical: bool, tag: str) -> dict:
    """Runs in every rank of a world that has joined both torch.distributed's default
    group and raytrain-x; returns {workload: {way: [samples/s per round]}} and, under
    "autotune", what tuning chose for each tuned workload."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import raytrain_x.torch as rx

    rank, size = dist.get_rank(), dist.get_world_size()
    out: dict[str, dict] = {"autotune": {}}
    for name in args.workloads:
        ways = _ways_for(name, args, hierarchical)
        if name in args.autotune:
            out["autotune"][name] = tune(name, args, tag)
        make_model, make_opt, data, loss_fn = _workload(name)
        out[name] = {w: [] for w in ways}
        for r in range(args.repeats):
            for way in ways:
                model = make_model()
                opt = make_opt(model)
                if way.startswith("ddp"):
                    model = DDP(model, bucket_cap_mb=float(way[3:]))
                    opt = make_opt(model)
                elif way.startswith("rx"):
                    cap = (SERIAL_MB if way == "rx-serial" else
                           float(way[4:]) if way.startswith("rx-b") else None)
                    opt = rx.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                                  bucket_cap_mb=cap)
                    knobs = {"hierarchical_allreduce": hierarchical_of(way),
                             **DEFAULT_FUSION}
                    if way == "rx-tuned":
                        knobs = dict(out["autotune"][name]["knobs"])
                    elif way.startswith("rx-t"):
                        mb, ms = way[4:].split("c")
                        knobs.update(fusion_threshold_bytes=int(float(mb) * 2**20),
                                     cycle_time_ms=float(ms))
                    agree_knobs(**knobs)
                counter = iter(range(1 << 30))
                trains = way != "solo" or rank == 0

                def step(model=model, opt=opt, counter=counter, trains=trains) -> None:
                    if trains:
                        x, y = data(rank, next(counter))
                        opt.zero_grad()
                        loss_fn(model(x), y).backward()
                        opt.step()

                exporting = _exporting(args.metrics_interval) if way == "rx-metrics" else None
                began = time.perf_counter()
                seconds = median_across_ranks(step, args.steps, warmup=2)
                if exporting is not None:
                    exporting.stop()
                    out.setdefault("metrics_export", []).append(
                        {"exports": exporting.exports, "busy_s": exporting.busy_s,
                         "elapsed_s": time.perf_counter() - began,
                         "mark_step_s": _mark_step_cost()})
                workers = 1 if way == "solo" else size
                out[name][way].append(BATCH[name] * workers / seconds)
                if rank == 0:
                    say(f"{name} round {r + 1}/{args.repeats} {way}: "
                        f"{BATCH[name] * workers / seconds:.1f} samples/s "
                        f"({seconds:.3f} s/step)")
                del model, opt, step
                gc.collect()  # DDP's reducer and autograd hooks can form cycles
    return out


def _mark_step_cost() -> float:
    """Seconds one `mark_step()` takes (what a step pays for its metrics), as timed over
    100,000 calls."""
    from raytrain_x.core import runtime

    clock = runtime.StepClock()
    start = time.perf_counter()
    for _ in range(100_000):
        clock.mark()
    return (time.perf_counter() - start) / 100_000


def _exporting(interval_s: float):
    """This rank's metrics exported every `interval_s`, as a Ray worker actor exports them
    (`WorkerActor._start_metrics`): its status read and recorded into Ray's metrics."""
    from raytrain_x.core import status
    from raytrain_x.ray import metrics

    exporter = metrics.WorkerExporter("real_networks", "bench", metrics.RayRecorder())
    return metrics.ExportThread(status.snapshot, exporter, interval_s).start()


# ----------------------------------------------------------------------------- one host
def _local_worker(rank: int, size: int, port: int, args, queue) -> None:
    import raytrain_x.torch as rx

    join_world(rank, size, port)
    rx.init()
    out = measure(args, hierarchical=False, tag="real_networks")
    if rank == 0:
        queue.put({"transport": rx.transport(), "results": out})
    rx.shutdown()


# ----------------------------------------------------------------------------- memory
def _memory_worker(rank: int, size: int, port: int, args, way: str, queue) -> None:
    """One way in a fresh world: peak resident memory of a few training steps."""
    import resource

    from torch.nn.parallel import DistributedDataParallel as DDP

    import raytrain_x.torch as rx

    join_world(rank, size, port)
    rx.init()
    name = args.workloads[0]
    make_model, make_opt, data, loss_fn = _workload(name)
    before = rss_mib()
    model = make_model()
    opt = make_opt(model)
    if way.startswith("ddp"):
        model = DDP(model, bucket_cap_mb=float(way[3:]))
        opt = make_opt(model)
    elif way == "rx":
        opt = rx.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    for step in range(4):
        x, y = data(rank, step)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    got = torch.tensor([peak, peak - before], dtype=torch.float64)
    torch.distributed.all_reduce(got, op=torch.distributed.ReduceOp.MAX)
    if rank == 0:
        queue.put({"peak_mb": got[0].item(), "training_mb": got[1].item()})
    rx.shutdown()


def memory(args) -> dict:
    """Peak memory per way, each in fresh processes (a process's peak never goes down)."""
    out = {}
    for name in args.workloads:
        one = argparse.Namespace(**{**vars(args), "workloads": [name]})
        out[name] = {way: run_ranks(_memory_worker, args.workers, one, way)
                     for way in ["floor", *(f"ddp{b:g}" for b in args.ddp_buckets), "rx"]}
    rows = [{"workload": name, "way": way, "peak MB": m["peak_mb"],
             "training MB": m["training_mb"],
             "peak vs ddp25": m["peak_mb"] / ways["ddp25"]["peak_mb"],
             "training vs ddp25": m["training_mb"] / ways["ddp25"]["training_mb"]}
            for name, ways in out.items() for way, m in ways.items()]
    print_table(rows, ["workload", "way", "peak MB", "training MB", "peak vs ddp25",
                       "training vs ddp25"])
    return {"memory": out, "rows": rows}


# ----------------------------------------------------------------------------- emulated
def _ray_worker(args) -> dict:
    """Runs in each RayExecutor worker of the emulated cluster."""
    import raytrain_x.torch as rx

    return emulated_world(lambda: measure(
        args, hierarchical=multi_level_world(),
        tag=f"real_networks_{args.hosts}x{rx.local_size()}"))


def _drive(args) -> None:
    """The driver, on host 0 of the emulated cluster: one world per --per-host value."""
    drive_worlds(args.hosts, args.per_host, args.inside,
                 lambda ex: ex.run(_ray_worker, args=[args])[0])


def summarise(results: dict[str, dict[str, list[float]]], workers: int) -> tuple[list, dict]:
    rows, summary = [], {}
    for name, ways in results.items():
        if name in ("autotune", "metrics_export"):
            continue
        med = {w: statistics.median(v) for w, v in ways.items()}
        ddps = {w: m for w, m in med.items() if w.startswith("ddp")}
        best_ddp = max(ddps, key=ddps.get)
        per_step = {w: BATCH[name] * (1 if w == "solo" else workers) / m
                    for w, m in med.items()}
        exposed = per_step["rx-serial"] - per_step["floor"]
        for way, values in ways.items():
            hidden = (1 - (per_step[way] - per_step["floor"]) / exposed
                      if way not in ("solo", "floor") and exposed > 0 else None)
            rows.append({"workload": name, "way": way, "samples/s": med[way],
                         "min": min(values), "max": max(values),
                         "spread %": 100 * (max(values) - min(values)) / med[way],
                         "vs floor": med[way] / med["floor"],
                         "vs ddp25": med[way] / med["ddp25"],
                         "vs best ddp": med[way] / med[best_ddp],
                         "scaling": (med[way] / (workers * med["solo"])
                                     if way != "solo" else 1.0),
                         "hidden": "" if hidden is None else hidden})
        summary[name] = {"median": med, "best_ddp": best_ddp, "seconds_per_step": per_step}
        if "rx-metrics" in med:
            # per round, as the ways ran side by side: a ratio of medians hides the pairing
            paired = [m / r for m, r in zip(ways["rx-metrics"], ways["rx"])]
            summary[name]["metrics_cost"] = {
                "step_ratio_median": 1 / statistics.median(paired),
                "step_ratio_per_round": [1 / p for p in paired]}
            print(f"{name}: a step with metrics exported "
                  f"takes {1 / statistics.median(paired):.4f}x one without "
                  f"(per round: {', '.join(f'{1 / p:.3f}' for p in paired)})")
            spent = results.get("metrics_export", [])
            if spent:
                busy = sum(e["busy_s"] for e in spent) / sum(e["elapsed_s"] for e in spent)
                each = sum(e["busy_s"] for e in spent) / max(sum(e["exports"] for e in spent), 1)
                mark = statistics.median(e["mark_step_s"] for e in spent)
                step = per_step["rx"]
                summary[name]["metrics_cost"].update(
                    export_busy_share=busy, export_s=each, mark_step_s=mark,
                    mark_step_share=mark / step)
                print(f"{name}: rank 0's exporter busy {100 * busy:.3f}% of the time "
                      f"({1e3 * each:.2f} ms per export); mark_step {1e6 * mark:.2f} us "
                      f"= {100 * mark / step:.5f}% of a {step:.3f} s step")
        grid = {w: m for w, m in med.items() if re.fullmatch(r"rx-t[\d.]+c[\d.]+", w)}
        if "rx-tuned" in med:
            # the default knobs are points of the landscape too, hierarchical off and on
            grid.update({w: med[w] for w in ("rx", other_hierarchy_way()) if w in med})
            best = max(grid, key=grid.get)
            summary[name]["autotune"] = {
                **results["autotune"][name], "grid_best": best,
                "tuned_over_grid_best": med["rx-tuned"] / grid[best],
                "tuned_over_default": med["rx-tuned"] / med["rx"]}
            print(f"{name}: autotune chose {results['autotune'][name]['knobs']}; tuned "
                  f"{med['rx-tuned'] / grid[best]:.3f}x the grid best ({best}), "
                  f"{med['rx-tuned'] / med['rx']:.3f}x the default")
    return rows, summary


def plot(sections: dict[str, list[dict]], path: Path) -> None:
    """Samples/s of every way as a share of the floor, one panel per world."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sections), figsize=(5.5 * len(sections), 4),
                             squeeze=False)
    for ax, (title, rows) in zip(axes[0], sections.items()):
        names = list(dict.fromkeys(r["workload"] for r in rows))
        ways = [w for w in dict.fromkeys(r["way"] for r in rows) if w != "solo"]
        width = 0.8 / len(ways)
        for i, way in enumerate(ways):
            values = [next((r["vs floor"] for r in rows
                            if r["workload"] == n and r["way"] == way), 0) for n in names]
            ax.bar([j + i * width for j in range(len(names))], values, width, label=way)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
        ax.set_ylim(0, 1.1)
        ax.axhline(1.0, color="black", lw=0.6)
        ax.set_ylabel("samples/s / compute floor")
        ax.set_title(title, fontsize=9)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["resnet18", "gpt"],
                        choices=sorted(BATCH))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per way and round")
    parser.add_argument("--ddp-buckets", type=float, nargs="+", default=[25.0, 5.0, 100.0])
    parser.add_argument("--rx-buckets", type=float, nargs="*", default=[],
                        help="raytrain-x with these fixed bucket sizes (MB) as well")
    parser.add_argument("--grid-mb", type=float, nargs="*", default=[],
                        help="fusion thresholds (MB) of the knob grid")
    parser.add_argument("--grid-ms", type=float, nargs="*", default=[1.0],
                        help="cycle times (ms) of the knob grid")
    add_place_arguments(parser)
    parser.add_argument("--autotune", nargs="*", default=[], choices=sorted(BATCH),
                        help="workloads to autotune first (then measured as rx-tuned)")
    parser.add_argument("--memory", action="store_true",
                        help="peak memory per way instead (one host, fresh processes each)")
    parser.add_argument("--metrics-cost", action="store_true",
                        help="add rx-metrics: rx exporting the job's metrics")
    parser.add_argument("--metrics-interval", type=float, default=1.0,
                        help="seconds between exports in rx-metrics (the default of jobs: 5)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--inside", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        _drive(args)
        return
    started = time.monotonic()
    if args.memory:
        print(f"wrote {write_json('real_networks_memory', memory(args), args.json)}")
        return
    if args.hosts == 1:
        worlds = {f"1 host x {args.workers}": (args.workers,
                                               run_ranks(_local_worker, args.workers, args))}
        where = "real_networks"
    else:
        raw = run_emulated(__file__, sys.argv[1:], args.hosts, max(args.per_host),
                           args.link_gbit)
        worlds = {f"{args.hosts} hosts x {k} ({args.link_gbit:g} Gbit/s)":
                  (args.hosts * int(k), v) for k, v in raw.items()}
        where = "real_networks_emulated"
    payload: dict = {"repeats": args.repeats, "steps": args.steps, "batch_per_worker": BATCH,
                     "link_gbit": args.link_gbit if args.hosts > 1 else None, "worlds": {}}
    sections = {}
    for title, (workers, got) in worlds.items():
        rows, summary = summarise(got["results"], workers)
        print(f"\n{title}, transport {got['transport']}")
        print_table(rows, ["workload", "way", "samples/s", "min", "max", "spread %",
                           "vs floor", "vs ddp25", "vs best ddp", "scaling", "hidden"])
        payload["worlds"][title] = {"workers": workers, "transport": got["transport"],
                                    "samples_per_s": got["results"], "rows": rows, **summary}
        sections[title] = rows
    payload["seconds"] = round(time.monotonic() - started, 1)
    path = write_json(where, payload, args.json)
    plot(sections, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
