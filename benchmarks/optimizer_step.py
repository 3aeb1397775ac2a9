"""One training step on a ResNet-50-shaped parameter set, 2 processes, several ways.

Same processes, same model, measured back to back:
  flat         one torch.distributed all_reduce of all gradient bytes (communication floor)
  backward     forward + backward + step, no communication
  ddp25        DistributedDataParallel(bucket_cap_mb=25)
  ddp<N>       DDP with other bucket sizes (--ddp-buckets)
  per_tensor   backward, then one all_reduce per gradient
  rx           raytrain_x.torch.DistributedOptimizer as the README calls it (each gradient
               sent when ready, fused in place up to the fusion threshold, 64 MB by default)
Then peak resident memory: each of `none` (no communication), `ddp25`, `rx` and
`rx_switch` (rx whose fusion threshold rank 0 switches every 3 steps: 1, 256, 25 MB, 0,
64 MB) runs alone in a fresh pair of processes for
the same steps; the peak RSS of the larger rank is kept.
Prints medians and ratios; writes results/optimizer_step.json.

Run: .venv/bin/python benchmarks/optimizer_step.py [--workers 2] [--repeats 10]
"""

from __future__ import annotations

import argparse
import resource

import torch
import torch.distributed as dist

from common import join_world, median_across_ranks, print_table, run_ranks, write_json


def _worker(rank: int, size: int, port: int, args, queue) -> None:
    import raytrain_x.torch as rx
    from raytrain_x.common.workloads import resnet50_parameter_shapes
    from raytrain_x.torch.workloads import shaped_model

    join_world(rank, size, port)
    rx.init()
    shapes = resnet50_parameter_shapes()
    scale = torch.ones(())
    results = {}

    model = shaped_model(shapes)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    flat = torch.ones(sum(p.numel() for p in model.parameters()))
    results["flat"] = median_across_ranks(lambda: dist.all_reduce(flat), args.repeats, warmup=3)

    def plain_step(after_backward=None):
        opt.zero_grad()
        model(scale).backward()
        if after_backward:
            after_backward()
        opt.step()

    results["backward"] = median_across_ranks(plain_step, args.repeats, warmup=3)

    def per_tensor():
        for p in model.parameters():
            dist.all_reduce(p.grad)

    results["per_tensor"] = median_across_ranks(lambda: plain_step(per_tensor), args.repeats,
                                                warmup=3)

    for cap in args.ddp_buckets:
        ddp_model = torch.nn.parallel.DistributedDataParallel(shaped_model(shapes),
                                                              bucket_cap_mb=cap)
        ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=1e-4)

        def ddp_step():
            ddp_opt.zero_grad()
            ddp_model(scale).backward()
            ddp_opt.step()

        results[f"ddp{cap:g}"] = median_across_ranks(ddp_step, args.repeats, warmup=3)

    for cap in args.rx_buckets:
        rx_model = shaped_model(shapes)
        rx_opt = rx.DistributedOptimizer(torch.optim.SGD(rx_model.parameters(), lr=1e-4),
                                         named_parameters=rx_model.named_parameters(),
                                         bucket_cap_mb=None if cap < 0 else cap)

        def rx_step():
            rx_opt.zero_grad()
            rx_model(scale).backward()
            rx_opt.step()

        key = "rx" if cap <= 0 else f"rx_bucket{cap:g}"
        results[key] = median_across_ranks(rx_step, args.repeats, warmup=3)
    rx.shutdown()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(results)


def _memory_worker(rank: int, size: int, port: int, method: str, steps: int, queue) -> None:
    """Trains `steps` steps one way only, then reports this job's peak RSS (max of ranks)."""
    from raytrain_x.common.workloads import resnet50_parameter_shapes
    from raytrain_x.torch.workloads import shaped_model

    join_world(rank, size, port)
    model = shaped_model(resnet50_parameter_shapes())
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    if method == "ddp25":
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    elif method.startswith("rx"):
        import raytrain_x.torch as rx

        rx.init()
        opt = rx.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    scale = torch.ones(())
    switches = [1, 256, 25, 0, 64] if method == "rx_switch" else []
    for i in range(steps):
        if switches and i % 3 == 1 and rank == 0:
            rx.set_knobs(rx.knobs().replace(fusion_threshold_bytes=switches.pop(0) << 20))
        opt.zero_grad()
        model(scale).backward()
        opt.step()
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if method.startswith("rx"):
        rx.shutdown()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(float(peak.item()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--ddp-buckets", type=float, nargs="+", default=[25.0, 4.0, 1.0, 100.0])
    parser.add_argument("--rx-buckets", type=float, nargs="+", default=[-1.0, 25.0, 4.0],
                        help="DistributedOptimizer bucket_cap_mb values: -1 = not given (the "
                        "default path: gradients fused in place up to the fusion threshold; "
                        "reported as rx), N > 0 = fixed buckets of N MB")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if 25.0 not in args.ddp_buckets:
        args.ddp_buckets.insert(0, 25.0)

    results = run_ranks(_worker, args.workers, args)
    memory = {m: run_ranks(_memory_worker, args.workers, m, max(args.repeats + 3, 17))
              for m in ("none", "ddp25", "rx", "rx_switch")}
    ddp_keys = [k for k in results if k.startswith("ddp")]
    best_ddp = min(ddp_keys, key=lambda k: results[k])
    rows = [{"method": k, "median ms": results[k] * 1e3,
             "x ddp25": results[k] / results["ddp25"], "x flat": results[k] / results["flat"]}
            for k in ["flat", "backward", "per_tensor", *ddp_keys,
                      *[k for k in results if k.startswith("rx")]]]
    print(f"{args.workers} workers, ResNet-50-shaped gradients (161 tensors, 25.6M float32)")
    print_table(rows, ["method", "median ms", "x ddp25", "x flat"])
    ratios = {"rx_over_ddp25": results["rx"] / results["ddp25"],
              "rx_over_best_ddp": results["rx"] / results[best_ddp], "best_ddp": best_ddp,
              "rx_over_flat": results["rx"] / results["flat"],
              "rx_rss_over_ddp25_rss": memory["rx"] / memory["ddp25"],
              "rx_switch_rss_over_ddp25_rss": memory["rx_switch"] / memory["ddp25"]}
    print_table([{"job": m, "peak RSS MB": mb, "x ddp25": mb / memory["ddp25"]}
                 for m, mb in memory.items()], ["job", "peak RSS MB", "x ddp25"])
    print(ratios)
    path = write_json("optimizer_step", {"workers": args.workers, "results": results,
                                         "peak_rss_mb": memory, "ratios": ratios}, args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
