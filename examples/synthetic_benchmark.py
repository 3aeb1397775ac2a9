"""Synthetic training throughput in samples/s (like Horovod's pytorch_synthetic_benchmark).

A model whose parameters have ResNet-50's shapes (or many small tensors), synthetic data,
DistributedOptimizer. Run on 2 workers:
    raytrain-x run -np 2 python examples/synthetic_benchmark.py --num-iters 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import raytrain_x.torch as rx
from raytrain_x.common.workloads import many_small_shapes, resnet50_parameter_shapes
from raytrain_x.torch.workloads import shaped_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["resnet50", "small"], default="resnet50")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-warmup-batches", type=int, default=3)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--fp16-allreduce", action="store_true")
    args = parser.parse_args()

    rx.init()
    torch.set_num_threads(1)
    shapes = resnet50_parameter_shapes() if args.model == "resnet50" else many_small_shapes()
    model = shaped_model(shapes)
    compression = rx.Compression.fp16 if args.fp16_allreduce else rx.Compression.none
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                  named_parameters=model.named_parameters(),
                                  compression=compression)
    rx.broadcast_parameters(model.state_dict(), root_rank=0)
    scale = torch.ones(())

    def batch() -> None:
        opt.zero_grad()
        model(scale).backward()
        opt.step()

    for _ in range(args.num_warmup_batches):
        batch()
    rates = []
    for i in range(args.num_iters):
        start = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            batch()
        rate = args.batch_size * args.num_batches_per_iter / (time.perf_counter() - start)
        rates.append(rate)
        if rx.rank() == 0:
            print(f"iter #{i}: {rate:.1f} samples/s per worker", flush=True)
    total = rx.allreduce(torch.tensor(statistics.median(rates)), op=rx.Sum, name="rate").item()
    if rx.rank() == 0:
        print(f"median {statistics.median(rates):.1f} samples/s per worker, "
              f"{total:.1f} samples/s on {rx.size()} workers", flush=True)
    rx.shutdown()


if __name__ == "__main__":
    main()
