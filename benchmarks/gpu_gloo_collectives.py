"""Allgather, reduce-scatter and allreduce of CUDA tensors over gloo (ranks sharing a GPU).

Each way in the same two processes, at a bucket's size and a whole model's:

  allgather       host       a host copy gathered by gloo, copied back to the GPU
                  allreduce  each block in its slot of a zeroed output, gloo's CUDA allreduce
                  broadcasts raytrain-x's way: one broadcast per member from its block, all
                             in flight (`TorchGroup.gather_by_broadcasts`)
  reduce-scatter  host       a host copy reduce-scattered by gloo, the share copied back
                  allreduce  gloo's CUDA allreduce of a copy, the share sliced off
                  alltoall   raytrain-x's way: each member's copy of the share, summed on the
                             GPU (`TorchGroup.reduce_scatter_by_alltoall`)
  allreduce       whole      gloo's CUDA allreduce of the whole tensor
                  pieces     of --piece-mb pieces, one after another
                  2 in flight  the same pieces, at most two outstanding (gloo's two threads)

Prints the median time per call (slower rank) and each way's ratio to the first way; writes
results/gpu_gloo_collectives.json.

Run: python benchmarks/gpu_gloo_collectives.py [--mb 25 437] [--repeats 5]
"""

from __future__ import annotations

import argparse

import torch

from common import join_world, median_across_ranks, print_table, run_ranks, write_json


def _worker(rank: int, size: int, port: int, args, queue) -> None:
    import torch.distributed as dist

    from raytrain_x.comm.torch_backend import TorchGroup

    join_world(rank, size, port, {"RAYTRAIN_X_GPU_OPERATIONS": "gloo"})
    store = dist.PrefixStore("gather", dist.distributed_c10d._get_default_store())
    group = TorchGroup(store, rank, size, 120.0, range(size))
    gloo = group._gloo
    rows = []
    for mb in args.mb:
        n = int(mb * 2**20 / 4) // size * size
        full = torch.randn(n, device="cuda")
        block = full[rank * (n // size):(rank + 1) * (n // size)].clone()
        out = torch.empty_like(full)

        def timed(fn):
            def call():
                fn()
                torch.cuda.synchronize()
            return median_across_ranks(call, args.repeats, warmup=2)

        def gather_host():
            host = torch.empty(out.shape, dtype=out.dtype)
            gloo._allgather_base(host, block.cpu()).wait()
            out.copy_(host)

        def gather_allreduce():
            out.zero_()
            out[rank * block.numel():(rank + 1) * block.numel()].copy_(block)
            group.allreduce(out)

        def scatter_allreduce():
            work = full.clone()
            group.allreduce(work)
            block.copy_(work[rank * block.numel():(rank + 1) * block.numel()])

        def scatter_host():
            host = torch.empty(block.shape, dtype=block.dtype)
            gloo._reduce_scatter_base(host, full.cpu()).wait()
            block.copy_(host)

        def pieces(in_flight: int):
            step = int(args.piece_mb * 2**20 / 4)
            outstanding = []
            for lo in range(0, n, step):
                outstanding.append(group.allreduce_async(full[lo:lo + step]))
                if len(outstanding) >= in_flight:
                    outstanding.pop(0)()
            for finish in outstanding:
                finish()

        found = {
            ("allgather", "host"): timed(gather_host),
            ("allgather", "allreduce"): timed(gather_allreduce),
            ("allgather", "broadcasts"): timed(lambda: group.gather_by_broadcasts(out, block)),
            ("reduce-scatter", "host"): timed(scatter_host),
            ("reduce-scatter", "allreduce"): timed(scatter_allreduce),
            ("reduce-scatter", "alltoall"): timed(lambda: group.reduce_scatter(block, full)),
            ("allreduce", "whole"): timed(lambda: group.allreduce(full)),
            ("allreduce", "pieces"): timed(lambda: pieces(1)),
            ("allreduce", "2 in flight"): timed(lambda: pieces(2)),
        }
        first = {}
        for (op, way), seconds in found.items():
            first.setdefault(op, seconds)
            rows.append({"op": op, "MB": mb, "way": way, "ms": seconds * 1e3,
                         "first/way": first[op] / seconds})
    if rank == 0:
        queue.put(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[25.0, 437.0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--piece-mb", type=float, default=25.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_gloo_collectives.py needs a CUDA device")
    rows = run_ranks(_worker, 2, args, timeout_s=600)
    print_table(rows, list(rows[0]))
    write_json("gpu_gloo_collectives", {"device": torch.cuda.get_device_name(0), "rows": rows},
               args.out)


if __name__ == "__main__":
    main()
