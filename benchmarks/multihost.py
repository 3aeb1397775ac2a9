"""Multi-host figures on an emulated cluster: 2 hosts x 2 workers, a shaped cross link.

The hosts are network namespaces with a Ray node each (`raytrain_x.testing.EmulatedCluster`);
the cross link is `tc tbf` at --link-gbit (1 Gbit/s) each way, loopback within a host. A
driver on host 0 starts 4 workers with `RayExecutor(num_hosts=2, num_workers_per_host=2)`;
in those same processes torch.distributed's gloo (the baseline) and raytrain-x are measured
back to back:

  small      4 KB allreduce latency, steady state: engine / raw gloo         (<= 1.3x)
  large      64 MB allreduce: engine (flat) / raw gloo                        (<= 1.0x)
  hier       64 MB allreduce: engine hierarchical / engine flat               (<= 0.75x)
  step       ResNet-50-shaped step: DistributedOptimizer / DDP(bucket 25 MB)  (<= 0.8x)
  autotune   tuned knobs (autotune's defaults) / re-measured best of a grid of fusion
             threshold x hierarchical allreduce, DistributedOptimizer steps   (>= 0.95x)

Each time is also given against the physical floor: the bytes that must cross a host's
link in one direction (an allreduce of S bytes over 2 hosts: S) over the link rate. Bytes
that actually crossed host 0's link are read from its interface counters.
Writes results/multihost.json.

Run alone, as root (it makes namespaces): .venv/bin/python benchmarks/multihost.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from raytrain_x.testing.waiting import free_port

from common import RESULTS_DIR, print_table, write_json
from common import samples_across_ranks as timed

HOSTS, PER_HOST = 2, 2
SMALL_BYTES = 4 << 10
LARGE_BYTES = 64 << 20


def _tx_bytes() -> int:
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def _measure(args: dict) -> dict:
    """Runs in each of the 4 Ray workers."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import raytrain_x.torch as rx
    from raytrain_x.common.workloads import resnet50_parameter_shapes
    from raytrain_x.torch.workloads import shaped_model

    torch.set_num_threads(1)
    rx.init()
    rank, size = rx.rank(), rx.size()
    # The baseline: torch.distributed's default gloo group over the same link.
    ip = _node_ip()
    master, port = rx.broadcast_object((ip, free_port(ip)) if rank == 0 else None,
                                       root_rank=0, name="baseline_store")
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # gloo's default is the hostname: loopback
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank,
                            world_size=size, timeout=timedelta(seconds=120))
    del os.environ["GLOO_SOCKET_IFNAME"]
    out: dict = {"transport": rx.transport()}

    def set_knobs(**changes) -> None:
        if rank == 0:
            rx.set_knobs(rx.knobs().replace(**changes))
        flag = torch.zeros(1)
        while True:  # the same number of calls on every rank
            current = rx.knobs()
            flag[0] = float(all(getattr(current, k) == v for k, v in changes.items()))
            rx.allreduce_(flag, op=rx.Min, name="knob_switch")
            if flag[0] == 1:
                return

    def with_tx(fn):
        before = _tx_bytes()
        result = fn()
        return result, _tx_bytes() - before

    if "small" in args["figures"]:
        small = torch.ones(SMALL_BYTES // 4)
        loop = args["small_loop"]

        def raw_loop():
            for _ in range(loop):
                dist.all_reduce(small)

        def rx_loop():
            for _ in range(loop):
                rx.allreduce_(small, op=rx.Sum, name="small")

        raw, eng = [], []
        for _ in range(args["repeats"]):  # interleaved: drift hits both alike
            raw += timed(raw_loop, 1)
            eng += timed(rx_loop, 1)
        out["small"] = {"raw_s": [t / loop for t in raw], "engine_s": [t / loop for t in eng]}

    if "large" in args["figures"] or "hier" in args["figures"]:
        big = torch.ones(LARGE_BYTES // 4)
        reps = args["repeats_large"]
        raw, raw_tx = with_tx(lambda: timed(lambda: dist.all_reduce(big), reps))
        set_knobs(hierarchical_allreduce=False)
        flat, flat_tx = with_tx(lambda: timed(
            lambda: rx.allreduce_(big, op=rx.Sum, name="big"), reps))
        set_knobs(hierarchical_allreduce=True)
        hier, hier_tx = with_tx(lambda: timed(
            lambda: rx.allreduce_(big, op=rx.Sum, name="big"), reps))
        set_knobs(hierarchical_allreduce=False)
        runs = reps + 1
        out["large"] = {"raw_s": raw, "flat_s": flat, "hier_s": hier,
                        "raw_tx_bytes": raw_tx / runs, "flat_tx_bytes": flat_tx / runs,
                        "hier_tx_bytes": hier_tx / runs}

    if "step" in args["figures"]:
        shapes = resnet50_parameter_shapes()
        scale = torch.ones(())
        reps = args["repeats_step"]
        ddp_model = torch.nn.parallel.DistributedDataParallel(shaped_model(shapes),
                                                              bucket_cap_mb=25)
        ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=1e-4)

        def ddp_step():
            ddp_opt.zero_grad()
            ddp_model(scale).backward()
            ddp_opt.step()

        model = shaped_model(shapes)
        opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                      named_parameters=model.named_parameters())

        def rx_step():
            opt.zero_grad()
            model(scale).backward()
            opt.step()

        step: dict = {"gradient_bytes": 4 * sum(p.numel() for p in model.parameters())}
        step["ddp25_s"], step["ddp25_tx_bytes"] = with_tx(lambda: timed(ddp_step, reps))
        for hierarchical in (False, True):
            set_knobs(hierarchical_allreduce=hierarchical)
            key = "rx_hier" if hierarchical else "rx_flat"
            step[f"{key}_s"], step[f"{key}_tx_bytes"] = with_tx(lambda: timed(rx_step, reps))
        for key in ("ddp25", "rx_flat", "rx_hier"):
            step[f"{key}_tx_bytes"] /= reps + 1
        set_knobs(hierarchical_allreduce=False)
        out["step"] = step

    dist.destroy_process_group()
    rx.shutdown()
    out["rank"] = rank
    return out


def _autotune(args: dict) -> dict:
    """Runs in each worker: autotune with the defaults users get on DistributedOptimizer
    steps, then a grid (fusion threshold x hierarchical allreduce) and the finalists
    re-measured in interleaved rounds."""
    import torch

    import raytrain_x.torch as rx
    from raytrain_x import Knobs
    from raytrain_x.common.autotune_config import AutotuneConfig
    from raytrain_x.common.workloads import resnet50_parameter_shapes
    from raytrain_x.core import runtime
    from raytrain_x.torch.workloads import shaped_model

    torch.set_num_threads(1)
    rx.init(autotune=AutotuneConfig(log_file=args["log"]))
    rank = rx.rank()
    model = shaped_model(resnet50_parameter_shapes())
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-5),
                                  named_parameters=model.named_parameters())
    scale = torch.ones(())

    def step() -> None:
        opt.zero_grad()
        model(scale).backward()
        opt.step()

    def measure(knobs: Knobs, steps: int) -> float:
        """Steps per second at `knobs`, after the switch and the bucket rebuild."""
        if rank == 0:
            rx.set_knobs(knobs)
        for _ in range(2):
            step()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        return steps / (time.perf_counter() - start)

    began = time.perf_counter()
    tuning_steps = 0
    while True:
        step()
        tuning_steps += 1
        sampler = runtime.autotune_sampler()
        done = torch.tensor([1.0 if sampler is None or sampler.finished else 0.0])
        if rx.allreduce(done, op=rx.Min, name="tuning_done").item() == 1.0:
            break
    tuning_wall_s = time.perf_counter() - began
    tuned = rx.knobs()
    sampler = runtime.autotune_sampler()
    grid = []
    for mb in args["sizes_mb"]:
        for hier in (False, True):
            knobs = tuned.replace(fusion_threshold_bytes=int(mb * 2**20),
                                  hierarchical_allreduce=hier)
            grid.append({"mb": mb, "hierarchical": hier,
                         "steps_s": measure(knobs, args["grid_steps"]), "knobs": knobs})
            if rank == 0:
                print(f"grid {mb} MB, hierarchical {hier}: {grid[-1]['steps_s']:.3f} steps/s",
                      flush=True)
    top = sorted(grid, key=lambda g: g["steps_s"], reverse=True)[:3]
    finalists = {f"grid {g['mb']:g} MB hier={int(g['hierarchical'])}": g["knobs"]
                 for g in top}
    finalists.update({"tuned": tuned, "default": Knobs()})
    settings = list(dict.fromkeys(finalists.values()))
    by_setting: dict = {k: [] for k in settings}
    for _ in range(args["rounds"]):
        for knobs in settings:
            by_setting[knobs].append(measure(knobs, args["grid_steps"]))
    rx.shutdown()
    for g in grid:
        del g["knobs"]
    return {"grid": grid, "rounds": {n: by_setting[k] for n, k in finalists.items()},
            "tuned": tuned.to_dict(), "tuning_steps": tuning_steps,
            "tuning_wall_s": tuning_wall_s,  # the sampler runs on rank 0 only
            "searched": sampler.searched if sampler else None,
            "left_out": sampler.left_out if sampler else None}


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def drive(args: argparse.Namespace) -> dict:
    """Runs on host 0, inside the emulated cluster; writes what it has to --inside after
    each stage."""
    import ray

    from raytrain_x.ray import RayExecutor

    ray.init(log_to_driver=True)
    ex = RayExecutor(num_hosts=HOSTS, num_workers_per_host=PER_HOST)
    ex.start()
    try:
        figures = [f for f in args.figures if f != "autotune"]
        out = ex.run(_measure, args=[{
            "figures": figures, "repeats": args.repeats, "small_loop": args.small_loop,
            "repeats_large": args.repeats_large, "repeats_step": args.repeats_step}])[0]
        Path(args.inside).write_text(json.dumps(out))
        if "autotune" in args.figures:
            out["autotune"] = ex.run(_autotune, args=[{
                "log": str(RESULTS_DIR / "multihost_autotune_log.csv"),
                "sizes_mb": [1, 4, 25, 64, 256], "grid_steps": args.repeats_step,
                "rounds": 3}])[0]
    finally:
        ex.shutdown()
        ray.shutdown()
    return out


def report(raw: dict, link_gbit: float) -> dict:
    rate = link_gbit * 1e9 / 8  # bytes per second, one direction
    med = statistics.median
    rows, ratios = [], {}

    def row(figure, samples, baseline_samples, baseline, target, floor_bytes, tx=None):
        value_s, baseline_s = med(samples), med(baseline_samples)
        floor_s = floor_bytes / rate
        ratio = value_s / baseline_s
        ratios[figure] = ratio
        rows.append({"figure": figure, "ms": value_s * 1e3, "baseline": baseline,
                     "baseline ms": baseline_s * 1e3, "ratio": ratio, "target": target,
                     "floor ms": floor_s * 1e3, "x floor": value_s / floor_s,
                     "MB crossed": "" if tx is None else tx / 1e6,
                     # how noisy: the spread of this figure's own samples
                     "spread %": 100 * (max(samples) - min(samples)) / value_s})

    if "small" in raw:
        s = raw["small"]
        row("small 4KB", s["engine_s"], s["raw_s"], "raw gloo", "<= 1.3", SMALL_BYTES)
    if "large" in raw:
        g = raw["large"]
        row("raw gloo 64MB", g["raw_s"], g["raw_s"], "raw gloo", "", LARGE_BYTES,
            g["raw_tx_bytes"])
        row("engine flat 64MB", g["flat_s"], g["raw_s"], "raw gloo", "<= 1.0", LARGE_BYTES,
            g["flat_tx_bytes"])
        row("engine hier 64MB", g["hier_s"], g["flat_s"], "engine flat", "<= 0.75",
            LARGE_BYTES, g["hier_tx_bytes"])
    if "step" in raw:
        st = raw["step"]
        nbytes = st["gradient_bytes"]
        row("DDP(25MB) step", st["ddp25_s"], st["ddp25_s"], "DDP(25MB)", "", nbytes,
            st["ddp25_tx_bytes"])
        row("DistributedOptimizer step (flat)", st["rx_flat_s"], st["ddp25_s"], "DDP(25MB)",
            "<= 0.8", nbytes, st["rx_flat_tx_bytes"])
        row("DistributedOptimizer step (hier)", st["rx_hier_s"], st["ddp25_s"], "DDP(25MB)",
            "<= 0.8", nbytes, st["rx_hier_tx_bytes"])
    print_table(rows, ["figure", "ms", "baseline", "baseline ms", "ratio", "target",
                       "floor ms", "x floor", "MB crossed", "spread %"])
    summary = {"rows": rows, "ratios": ratios}
    if "autotune" in raw:
        a = raw["autotune"]
        final = {name: statistics.median(v) for name, v in a["rounds"].items()}
        best = max((k for k in final if k.startswith("grid")), key=lambda k: final[k])
        grid_hier = max(a["grid"], key=lambda g: g["steps_s"])["hierarchical"]
        summary["autotune"] = {
            "tuned_knobs": a["tuned"], "grid_best": best,
            "tuned_over_grid_best": final["tuned"] / final[best],
            "tuned_over_default": final["tuned"] / final["default"],
            "grid_says_hierarchical_wins": grid_hier,
            "tuned_hierarchical": a["tuned"]["hierarchical_allreduce"],
            "final_steps_s": final, "tuning_steps": a["tuning_steps"],
            "tuning_wall_s": a["tuning_wall_s"], "searched": a["searched"]}
        ratios["autotune_over_grid_best"] = final["tuned"] / final[best]
        print(f"autotune picked {a['tuned']} in {a['tuning_steps']} steps "
              f"({a['tuning_wall_s']:.0f}s); grid best: {best}")
        print_table([{"setting": k, "steps/s": v, "x grid best": v / final[best]}
                     for k, v in final.items()], ["setting", "steps/s", "x grid best"])
    return summary


def plot(rows: list[dict], path: Path) -> None:
    """Each figure's time beside its baseline and the physical floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["figure"] != "small 4KB"]  # microseconds: its own scale
    fig, ax = plt.subplots(figsize=(9, 4))
    xs = range(len(rows))
    ax.bar([x - 0.27 for x in xs], [r["ms"] for r in rows], 0.27, label="measured")
    ax.bar(list(xs), [r["baseline ms"] for r in rows], 0.27, label="baseline")
    ax.bar([x + 0.27 for x in xs], [r["floor ms"] for r in rows], 0.27, label="link floor")
    ax.set_xticks(list(xs), [r["figure"].replace(" step", "\nstep") for r in rows],
                  fontsize=7)
    ax.set_ylabel("ms")
    ax.set_title(f"{HOSTS} hosts x {PER_HOST} workers, emulated link")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-gbit", type=float, default=1.0)
    parser.add_argument("--figures", nargs="+", default=["small", "large", "step", "autotune"],
                        choices=["small", "large", "step", "autotune"])
    parser.add_argument("--repeats", type=int, default=7, help="small-allreduce loops")
    parser.add_argument("--small-loop", type=int, default=200)
    parser.add_argument("--repeats-large", type=int, default=5)
    parser.add_argument("--repeats-step", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--inside", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.inside:  # the driver, on host 0
        Path(args.inside).write_text(json.dumps(drive(args)))
        return

    from raytrain_x.testing import EmulatedCluster

    inner = RESULTS_DIR / "multihost.raw.json"
    RESULTS_DIR.mkdir(exist_ok=True)
    began = time.monotonic()
    with EmulatedCluster(hosts=HOSTS, workers_per_host=PER_HOST,
                         link_gbit=args.link_gbit) as cluster:
        print(f"emulated cluster up in {time.monotonic() - began:.1f}s: {HOSTS} hosts x "
              f"{PER_HOST} workers, {args.link_gbit:g} Gbit/s link", flush=True)
        cmd = [sys.executable, __file__, "--inside", str(inner), "--figures", *args.figures,
               "--repeats", str(args.repeats), "--small-loop", str(args.small_loop),
               "--repeats-large", str(args.repeats_large),
               "--repeats-step", str(args.repeats_step)]
        done = cluster.run(cmd, capture_output=False, timeout_s=3000)
        if done.returncode != 0 and not inner.exists():
            raise SystemExit(f"the driver on host 0 failed (exit {done.returncode})")
        if done.returncode != 0:
            print(f"the driver on host 0 failed (exit {done.returncode}); reporting the "
                  "stages it finished", flush=True)
    raw = json.loads(inner.read_text())
    inner.unlink()
    print(f"transport: {raw['transport']}; {time.monotonic() - began:.0f}s in all")
    summary = report(raw, args.link_gbit)
    path = write_json("multihost", {"hosts": HOSTS, "workers_per_host": PER_HOST,
                                    "link_gbit": args.link_gbit, "raw": raw, **summary},
                      args.json)
    print(f"wrote {path}")
    if len(summary["rows"]) > 1:
        png = path.with_suffix(".png")
        plot(summary["rows"], png)
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
