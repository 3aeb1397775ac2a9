"""A training step on the GPU: raytrain-x's DistributedOptimizer against DDP, same processes.

An MLP (--width, --layers; ~25M parameters by default) on CUDA, measured back to back in
the same processes:
  none   forward + backward + step, no communication
  ddp    DistributedDataParallel (bucket_cap_mb=25) over the default group
  rx     raytrain_x.torch.DistributedOptimizer as the README calls it
With --workers 2 both ranks share GPU 0, so every CUDA collective runs over gloo (NCCL
refuses two ranks on one device; RAYTRAIN_X_GPU_OPERATIONS=gloo and a gloo default group
for DDP); with --workers 1 raytrain-x takes NCCL and DDP its own one-rank group. Prints
median step times (slowest rank) and the ratio rx/ddp; writes results/gpu_step.json.

Run: python benchmarks/gpu_step.py --workers 2   (then --workers 1)
"""

from __future__ import annotations

import argparse

import torch

from common import join_world, median_across_ranks, print_table, run_ranks, write_json


def _model(args) -> torch.nn.Module:
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers).cuda()


def _worker(rank: int, size: int, port: int, args, queue) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import raytrain_x.torch as rx

    env = {"RAYTRAIN_X_GPU_OPERATIONS": "gloo"} if size > 1 else {}
    join_world(rank, size, port, env)
    rx.init()
    x = torch.randn(args.batch, args.width, device="cuda")

    def timed(model, opt):
        def step():
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            torch.cuda.synchronize()
        return median_across_ranks(step, args.repeats, warmup=3)

    results = {}
    torch.manual_seed(0)
    model = _model(args)
    results["none"] = timed(model, torch.optim.SGD(model.parameters(), lr=1e-4))
    ddp = DistributedDataParallel(model, bucket_cap_mb=25)
    results["ddp"] = timed(ddp, torch.optim.SGD(ddp.parameters(), lr=1e-4))
    model = _model(args)
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                  named_parameters=model.named_parameters())
    results["rx"] = timed(model, opt)
    results["params"] = sum(p.numel() for p in model.parameters())
    results["transport"] = "nccl" if size == 1 else "gloo (ranks share one GPU)"
    rx.shutdown()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_step.py needs a CUDA device")
    res = run_ranks(_worker, args.workers, args, timeout_s=600)
    row = {"workers": args.workers, "device": torch.cuda.get_device_name(0),
           "params_M": res["params"] / 1e6, "transport": res["transport"],
           "none_ms": res["none"] * 1e3, "ddp_ms": res["ddp"] * 1e3, "rx_ms": res["rx"] * 1e3,
           "rx/ddp": res["rx"] / res["ddp"]}
    print_table([row], list(row))
    write_json(f"gpu_step_{args.workers}", row, args.out)


if __name__ == "__main__":
    main()
