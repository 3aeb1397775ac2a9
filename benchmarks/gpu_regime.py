"""The step rates of a GPU on this CPU machine: compute that takes no CPU.

Each layer of the model has a real network's parameter shapes (ResNet-50: 161 tensors,
25.6M float32; or the GPT workload's) and its forward and backward wait their share of a
set step time with the CPU released (`time.sleep` inside a custom autograd function), so
gradients appear one by one in backward's order, as a GPU's kernels would produce them,
while the CPU is free for communication. A backward hands each parameter the same
pre-made gradient (no CPU spent making it). What is left to measure is what the GPU
regime exposes: the engine's own costs per step (negotiation, cycle wake-ups, Python per
tensor, the first bucket's wait), against DDP's buckets.

Ways, in the same processes, interleaved round by round (--repeats rounds):
  floor      every worker steps on its own at once (no communication): the compute floor
  ddp<N>     DistributedDataParallel with bucket_cap_mb=N (--ddp-buckets: 5 25 100)
  rx         raytrain_x.torch.DistributedOptimizer with its defaults
  rx-g<M>c<C> the same at fusion threshold M MB and cycle time C ms (--grid-mb, --grid-ms)
  rx-b<N>    the same with fixed gradient buckets of N MB, as DDP's (--rx-buckets)
  rx-hier    the same with hierarchical allreduce on, or rx-flat with it off, whichever is
             not the default (several hosts with several workers: where it applies)
  rx-tuned   the same at the knobs autotune chose for this step time in this world
             (--autotune: tuned first, with the settings users get; the log is kept)
Reports per step time (--step-ms: 10 30 100) and way: seconds per step (median of the
rounds' medians), the overhead over the floor, and the share of communication hidden
behind backward: 1 - (t - t_floor) / (t_serial - t_floor), with t_serial a step with one
allreduce of every gradient after backward over the way's own transport (`serial`: gloo,
as DDP; `rx-serial`: raytrain-x's, shared memory on one host), in the same rounds; and
`cpu ms`, the CPU time a step takes in the busier rank's process (every thread: the
framework's, the engine's, gloo's), median of the rounds.

Places: one host (--workers ranks as processes; shared memory for raytrain-x, gloo over
loopback for DDP and the serial reference), or an emulated cluster (--hosts 2: network
namespaces, one Ray node per host, --link-gbit links; one world per --per-host value, the
ranks RayExecutor workers; every way crosses the same link). Writes
results/gpu_regime[_emulated][_gpt].json.

Run alone: .venv/bin/python benchmarks/gpu_regime.py [--step-ms 10 30 100] [--repeats 5]
           [--autotune] [--timeline] [--hosts 2 --per-host 1 2]   (emulated hosts: as root)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

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
    run_emulated,
    run_ranks,
    say,
    write_json,
)

FORWARD_SHARE = 1 / 3  # a step's compute: a third forward, two thirds backward


def _shapes(workload: str) -> list[tuple[int, ...]]:
    """The parameters' shapes in registration order: ResNet-50's, or those of the GPT
    workload of the real-network benchmark (6 layers, width 512: 23.2M parameters)."""
    from raytrain_x.common import workloads
    from raytrain_x.torch.workloads import GPTDecoder

    if workload == "resnet50":
        return workloads.resnet50_parameter_shapes()
    return [tuple(p.shape) for p in GPTDecoder().parameters()]


class Compute:
    """Waits out the compute it is owed, with the CPU released, once a millisecond or more
    is owed (a sleep per layer would add each sleep's own overhead, tens of microseconds,
    161 times a pass); what a sleep overshoots is taken off the next."""

    def __init__(self) -> None:
        self.owed = 0.0

    def run(self, seconds: float) -> None:
        self.owed += seconds
        if self.owed >= 1e-3:
            start = time.perf_counter()
            time.sleep(self.owed)
            self.owed -= time.perf_counter() - start


def sleeping_model(shapes: list[tuple[int, ...]], step_s: float):
    """A model whose layer i holds a parameter of shape `shapes[i]`; forward and backward
    wait their share of `step_s` per layer (in proportion to its size, `Compute`) and
    backward hands each parameter the same pre-made gradient."""
    import torch

    total = sum(int(torch.Size(s).numel()) for s in shapes)
    compute = Compute()

    class Layer(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, forward_s, backward_s, grad):
            ctx.backward_s, ctx.grad = backward_s, grad
            compute.run(forward_s)
            return x.clone()

        @staticmethod
        def backward(ctx, grad_out):
            compute.run(ctx.backward_s)
            return grad_out, ctx.grad, None, None, None

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.weights = torch.nn.ParameterList(
                torch.nn.Parameter(torch.randn(s, generator=g) * 0.01) for s in shapes)
            self.grads = [torch.full(s, 1e-3) for s in shapes]
            self.shares = [int(torch.Size(s).numel()) / total for s in shapes]

        def forward(self, x):
            for w, g, share in zip(self.weights, self.grads, self.shares):
                x = Layer.apply(x, w, step_s * FORWARD_SHARE * share,
                                step_s * (1 - FORWARD_SHARE) * share, g)
            return x.sum()

    return Model()


def no_update(params):
    """An optimizer whose step changes nothing: on a GPU the update is a kernel, not CPU
    work; what is measured is getting the gradients there."""
    import torch

    class NoUpdate(torch.optim.Optimizer):
        def __init__(self, params) -> None:
            super().__init__(params, {})

        def step(self, closure=None):
            return None

    return NoUpdate(params)


def measure(rank: int, size: int, args, tag: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import raytrain_x.torch as rx

    torch.set_num_threads(1)
    # where hierarchical allreduce applies, the way with the other setting than the default
    other = [other_hierarchy_way()] if multi_level_world() else []
    out: dict[str, dict[str, list[float]]] = {}
    cpu: dict[str, dict[str, list[float]]] = {}  # CPU seconds a step, the busier rank's
    engine: dict[str, list[dict[str, float]]] = {}
    tuned: dict[str, dict] = {}
    x = torch.ones(1, requires_grad=True)
    for step_ms in args.step_ms:
        shapes = _shapes(args.workload)
        ways = ["floor", *(f"ddp{b:g}" for b in args.ddp_buckets), "rx",
                *other,
                *(f"rx-g{mb:g}c{ms:g}" for mb in args.grid_mb for ms in args.grid_ms),
                *(f"rx-b{mb:g}" for mb in args.rx_buckets),
                "serial", "rx-serial", *(["rx-tuned"] if args.autotune else [])]
        if args.autotune:
            tuned[str(step_ms)] = _tune(shapes, step_ms, x, tag)
        out[str(step_ms)] = {w: [] for w in ways}
        cpu[str(step_ms)] = {w: [] for w in ways}
        for r in range(args.repeats):
            for way in ways:
                model = sleeping_model(shapes, step_ms / 1000)
                opt = no_update(model.parameters())
                if way.startswith("ddp"):
                    model = DDP(model, bucket_cap_mb=float(way[3:]))
                    opt = no_update(model.parameters())
                if way.startswith("rx"):  # the serial reference at the default knobs
                    agree_knobs(**_knobs_of(way, tuned.get(str(step_ms))))
                if way.startswith("rx") and way != "rx-serial":
                    cap = float(way[4:]) if way.startswith("rx-b") else None
                    opt = rx.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                                  bucket_cap_mb=cap)
                flat = (torch.zeros(sum(p.numel() for p in model.parameters()))
                        if way.endswith("serial") else None)

                def step(model=model, opt=opt, way=way, flat=flat) -> None:
                    opt.zero_grad()
                    model(x).backward()
                    if way == "serial":  # every gradient in one allreduce after backward
                        dist.all_reduce(flat)
                    elif way == "rx-serial":
                        rx.allreduce_(flat, op=rx.Sum, name="gpu_regime.serial")
                    opt.step()

                before = _engine_counts()
                traced = args.timeline and way == "rx" and r == args.repeats - 1
                if traced:  # rank 0's engine trace of the default way's last round
                    RESULTS_DIR.mkdir(exist_ok=True)
                    rx.start_timeline(str(RESULTS_DIR / f"{tag}_{step_ms:g}ms_timeline.json"),
                                      mark_cycles=True)
                cpu_before = time.process_time()
                seconds = median_across_ranks(step, args.steps, warmup=2)
                cpu_step = torch.tensor([(time.process_time() - cpu_before) / (args.steps + 2)])
                dist.all_reduce(cpu_step, op=dist.ReduceOp.MAX)
                cpu[str(step_ms)][way].append(cpu_step.item())
                if traced:
                    rx.stop_timeline()
                out[str(step_ms)][way].append(seconds)
                if way == "rx":  # what the engine did per step (barriers included)
                    after = _engine_counts()
                    engine.setdefault(str(step_ms), []).append(
                        {k: (after[k] - before[k]) / (args.steps + 2) for k in after})
                if rank == 0:
                    say(f"{step_ms:g} ms round {r + 1}/{args.repeats} {way}: "
                        f"{1000 * seconds:.1f} ms/step")
                del model, opt, step
    return {"times": out, "cpu": cpu, "engine": engine, "autotune": tuned}


def _knobs_of(way: str, tuned: dict | None) -> dict:
    """Every knob a way of raytrain-x runs with (none left over from the way before): the
    defaults, autotune's choice, hierarchical allreduce on or off, or a grid point
    (rx-g<fusion MB>c<cycle ms>)."""
    from raytrain_x import Knobs

    knobs = Knobs().to_dict()
    if way == "rx-tuned":
        knobs.update(tuned["knobs"])
    elif way in ("rx-hier", "rx-flat"):
        knobs["hierarchical_allreduce"] = hierarchical_of(way)
    elif way.startswith("rx-g"):
        mb, ms = way[4:].split("c")
        knobs.update(fusion_threshold_bytes=int(float(mb) * 2**20), cycle_time_ms=float(ms))
    return knobs


def _tune(shapes: list[tuple[int, ...]], step_ms: float, x, tag: str) -> dict:
    """Autotune on the sleeping model at `step_ms`, with the settings users get."""
    import raytrain_x.torch as rx

    def make_step():
        model = sleeping_model(shapes, step_ms / 1000)
        opt = rx.DistributedOptimizer(no_update(model.parameters()),
                                      named_parameters=model.named_parameters())

        def step() -> None:
            opt.zero_grad()
            model(x).backward()
            opt.step()
        return step

    return autotune_knobs(make_step, RESULTS_DIR / f"{tag}_{step_ms:g}ms_autotune.csv", 1,
                          f"{step_ms:g} ms")


def _engine_counts() -> dict[str, float]:
    """The engine's counters now (`EngineStats`), the ones a step's cost shows in."""
    from raytrain_x.core import status

    return {k: v for k, v in status.engine_counters().items()
            if k not in ("bytes", "seconds", "speculation_misses", "stalls")}


def _worker(rank: int, size: int, port: int, args, queue) -> None:
    import raytrain_x.torch as rx

    join_world(rank, size, port)
    rx.init()
    got = measure(rank, size, args, _name(args))
    if rank == 0:
        queue.put({"transport": rx.transport(), "results": got})
    rx.shutdown()


def _ray_worker(args) -> dict:
    """Runs in each RayExecutor worker of the emulated cluster."""
    import raytrain_x.torch as rx

    return emulated_world(lambda: measure(rx.rank(), rx.size(), args,
                                          f"{_name(args)}_{args.hosts}x{rx.local_size()}"))


def _name(args) -> str:
    """The results' file name: gpu_regime[_emulated][_gpt]."""
    return "_".join(["gpu_regime", *(["emulated"] if args.hosts > 1 else []),
                     *([args.workload] if args.workload != "resnet50" else [])])


def summarise(results: dict[str, dict[str, list[float]]],
              cpu: dict[str, dict[str, list[float]]]) -> list[dict]:
    rows = []
    for step_ms, ways in results.items():
        med = {w: statistics.median(v) for w, v in ways.items()}
        ddps = {w: m for w, m in med.items() if w.startswith("ddp")}
        best = min(ddps, key=ddps.get)
        for way, values in ways.items():
            if way.endswith("serial"):
                continue
            exposed = med["rx-serial" if way.startswith("rx") else "serial"] - med["floor"]
            rows.append({
                "step ms": step_ms, "way": way, "ms/step": 1000 * med[way],
                "min": 1000 * min(values), "max": 1000 * max(values),
                "vs floor": med[way] / med["floor"],
                "vs ddp25": med[way] / med["ddp25"] if "ddp25" in med else "",
                "vs best ddp": med[way] / med[best],
                "hidden": (1 - (med[way] - med["floor"]) / exposed
                           if way != "floor" and exposed > 0 else ""),
                "cpu ms": 1000 * statistics.median(cpu[step_ms][way])})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["resnet50", "gpt"], default="resnet50")
    parser.add_argument("--step-ms", type=float, nargs="+", default=[10.0, 30.0, 100.0])
    parser.add_argument("--ddp-buckets", type=float, nargs="+", default=[5.0, 25.0, 100.0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per way and round")
    parser.add_argument("--rx-buckets", type=float, nargs="*", default=[],
                        help="also raytrain-x with fixed gradient buckets of these MB")
    parser.add_argument("--grid-mb", type=float, nargs="*", default=[],
                        help="fusion thresholds (MB) of a grid of rx ways (with --grid-ms)")
    parser.add_argument("--grid-ms", type=float, nargs="*", default=[],
                        help="cycle times (ms) of the grid")
    parser.add_argument("--autotune", action="store_true",
                        help="autotune each step time first, then measure it as rx-tuned")
    parser.add_argument("--timeline", action="store_true",
                        help="write rank 0's engine trace of the rx way's last round "
                             "(results/<name>_<step>ms_timeline.json, chrome://tracing)")
    add_place_arguments(parser)
    parser.add_argument("--json", default=None)
    parser.add_argument("--inside", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        drive_worlds(args.hosts, args.per_host, args.inside,
                     lambda ex: ex.run(_ray_worker, args=[args])[0])
        return
    started = time.monotonic()
    if args.hosts == 1:
        worlds = {f"1 host x {args.workers}": run_ranks(_worker, args.workers, args)}
    else:
        raw = run_emulated(__file__, sys.argv[1:], args.hosts, max(args.per_host),
                           args.link_gbit)
        worlds = {f"{args.hosts} hosts x {k} ({args.link_gbit:g} Gbit/s)": v
                  for k, v in raw.items()}
    payload: dict = {"args": vars(args), "worlds": {}}
    for title, got in worlds.items():
        rows = summarise(got["results"]["times"], got["results"]["cpu"])
        print(f"\n{args.workload}, {title}, transport {got['transport']}")
        print_table(rows, ["step ms", "way", "ms/step", "min", "max", "vs floor", "vs ddp25",
                           "vs best ddp", "hidden", "cpu ms"])
        per_step = [{"step ms": step_ms, **{k: statistics.median(r[k] for r in rounds)
                                            for k in rounds[0]}}
                    for step_ms, rounds in got["results"]["engine"].items()]
        print("\nthe engine per rx step (medians of the rounds; the timing's barriers included)")
        print_table(per_step, list(per_step[0]))
        tuned = tuned_summary(got["results"])
        for line in tuned:
            print(line["line"])
        payload["worlds"][title] = {
            "transport": got["transport"], "results": got["results"]["times"],
            "engine": per_step, "rows": rows, "autotune": got["results"]["autotune"],
            "tuned": tuned}
    payload["seconds"] = round(time.monotonic() - started, 1)
    path = write_json(_name(args), payload, args.json)
    print(f"wrote {path}")


def tuned_summary(results: dict) -> list[dict]:
    """Per tuned step time: the knobs chosen, and the tuned step against the default, the
    grid's best (the default and the rx-g points measured in the same rounds) and DDP's
    default bucket. A speed ratio above 1 is the tuned step's gain."""
    out = []
    for step_ms, tuned in results["autotune"].items():
        med = {w: statistics.median(v) for w, v in results["times"][step_ms].items()}
        grid = {w: m for w, m in med.items() if w == "rx" or w.startswith("rx-g")}
        best = min(grid, key=grid.get)
        row = {"step ms": step_ms, "knobs": tuned["knobs"], "steps": tuned["steps"],
               "speed_vs_default": med["rx"] / med["rx-tuned"],
               "speed_vs_grid_best": grid[best] / med["rx-tuned"], "grid_best": best,
               "speed_vs_ddp25": med["ddp25"] / med["rx-tuned"] if "ddp25" in med else None}
        row["line"] = (f"{step_ms} ms: autotune chose {tuned['knobs']} in {tuned['steps']} "
                       f"steps; tuned step {row['speed_vs_default']:.3f}x as fast as the "
                       f"default, {row['speed_vs_grid_best']:.3f}x as fast as the grid's best "
                       f"({best})" + (f", {row['speed_vs_ddp25']:.3f}x as fast as DDP 25 MB"
                                      if row["speed_vs_ddp25"] else ""))
        out.append(row)
    return out


if __name__ == "__main__":
    main()
