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
  autotune   (--autotune) tuned knobs / re-measured best of a grid that includes
             hierarchical allreduce, DistributedOptimizer steps               (>= 0.95x)

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, print_table, write_json  # noqa: E402

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
    master, port = rx.broadcast_object((ip, _free_port(ip)) if rank == 0 else None,
                                       root_rank=0, name="baseline_store")
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # gloo's default is the hostname: loopback
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank,
                            world_size=size, timeout=timedelta(seconds=120))
    del os.environ["GLOO_SOCKET_IFNAME"]
    out: dict = {"transport": rx.transport()}

    def timed(fn, repeats: int, warmup: int = 1) -> list[float]:
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        worst = torch.tensor(samples, dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest
        return worst.tolist()

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


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _free_port(ip: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def drive(args: argparse.Namespace) -> dict:
    """Runs on host 0, inside the emulated cluster."""
    import ray

    from raytrain_x.ray import RayExecutor

    ray.init(log_to_driver=True)
    ex = RayExecutor(num_hosts=HOSTS, num_workers_per_host=PER_HOST)
    ex.start()
    try:
        results = ex.run(_measure, args=[{
            "figures": args.figures, "repeats": args.repeats, "small_loop": args.small_loop,
            "repeats_large": args.repeats_large, "repeats_step": args.repeats_step}])
    finally:
        ex.shutdown()
        ray.shutdown()
    return results[0]


def report(raw: dict, link_gbit: float) -> dict:
    rate = link_gbit * 1e9 / 8  # bytes per second, one direction
    med = statistics.median
    rows, ratios = [], {}

    def row(figure, value_s, baseline_s, baseline, target, floor_bytes, tx=None):
        floor_s = floor_bytes / rate
        ratio = value_s / baseline_s
        ratios[figure] = ratio
        rows.append({"figure": figure, "ms": value_s * 1e3, "baseline": baseline,
                     "baseline ms": baseline_s * 1e3, "ratio": ratio, "target": target,
                     "floor ms": floor_s * 1e3, "x floor": value_s / floor_s,
                     "MB crossed": "" if tx is None else tx / 1e6})

    if "small" in raw:
        s = raw["small"]
        row("small 4KB", med(s["engine_s"]), med(s["raw_s"]), "raw gloo", "<= 1.3",
            SMALL_BYTES)
    if "large" in raw:
        g = raw["large"]
        row("raw gloo 64MB", med(g["raw_s"]), med(g["raw_s"]), "raw gloo", "",
            LARGE_BYTES, g["raw_tx_bytes"])
        row("engine flat 64MB", med(g["flat_s"]), med(g["raw_s"]), "raw gloo", "<= 1.0",
            LARGE_BYTES, g["flat_tx_bytes"])
        row("engine hier 64MB", med(g["hier_s"]), med(g["flat_s"]), "engine flat", "<= 0.75",
            LARGE_BYTES, g["hier_tx_bytes"])
    if "step" in raw:
        st = raw["step"]
        nbytes = st["gradient_bytes"]
        row("DDP(25MB) step", med(st["ddp25_s"]), med(st["ddp25_s"]), "DDP(25MB)", "",
            nbytes, st["ddp25_tx_bytes"])
        row("DistributedOptimizer step (flat)", med(st["rx_flat_s"]), med(st["ddp25_s"]),
            "DDP(25MB)", "<= 0.8", nbytes, st["rx_flat_tx_bytes"])
        row("DistributedOptimizer step (hier)", med(st["rx_hier_s"]), med(st["ddp25_s"]),
            "DDP(25MB)", "<= 0.8", nbytes, st["rx_hier_tx_bytes"])
    print_table(rows, ["figure", "ms", "baseline", "baseline ms", "ratio", "target",
                       "floor ms", "x floor", "MB crossed"])
    return {"rows": rows, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-gbit", type=float, default=1.0)
    parser.add_argument("--figures", nargs="+", default=["small", "large", "step"],
                        choices=["small", "large", "step"])
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
        if done.returncode != 0:
            raise SystemExit(f"the driver on host 0 failed (exit {done.returncode})")
    raw = json.loads(inner.read_text())
    inner.unlink()
    print(f"transport: {raw['transport']}; {time.monotonic() - began:.0f}s in all")
    summary = report(raw, args.link_gbit)
    path = write_json("multihost", {"hosts": HOSTS, "workers_per_host": PER_HOST,
                                    "link_gbit": args.link_gbit, "raw": raw, **summary},
                      args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
