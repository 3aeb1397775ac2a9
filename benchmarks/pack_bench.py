"""Native pack+unpack of a ResNet-50-shaped gradient set vs torch.cat + copy-back.

Same process, same tensors: reports GB/s and ratios against
  * torch.cat + copy-back (what a pure-PyTorch fusion buffer costs), and
  * one memcpy-speed copy of the same bytes (the floor).

Run: .venv/bin/python benchmarks/pack_bench.py [--repeats 30] [--json PATH]
"""

from __future__ import annotations

import argparse

import torch

from raytrain_x.common.workloads import resnet50_parameter_shapes  # noqa: E402
from raytrain_x.engine import FusionBufferPool, pack, unpack  # noqa: E402

from common import median_seconds, print_table, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", default=None,
                        help="output path (default results/pack_bench.json)")
    args = parser.parse_args()

    torch.manual_seed(0)
    grads = [torch.randn(s) for s in resnet50_parameter_shapes()]
    elements = sum(g.numel() for g in grads)
    nbytes = elements * 4
    print(f"{len(grads)} tensors, {elements / 1e6:.1f}M float32 ({nbytes / 2**20:.0f} MiB), "
          f"torch threads {torch.get_num_threads()}")

    pool = FusionBufferPool()
    buffer = pool.get(torch.float32, nbytes)
    names = [f"grad.{i}" for i in range(len(grads))]

    def native_pack() -> None:
        pack(grads, buffer, names=names)

    def native_round_trip() -> None:
        pack(grads, buffer, prescale=0.5, names=names)
        unpack(buffer, grads, postscale=2.0, names=names)

    sizes = [g.numel() for g in grads]

    def torch_round_trip() -> None:
        flat = torch.cat([g.view(-1) for g in grads]).mul_(0.5)
        for g, chunk in zip(grads, flat.split(sizes)):
            g.copy_(chunk.view_as(g)).mul_(2.0)

    src = torch.randn(elements)
    dst = torch.empty(elements)

    def one_memcpy() -> None:
        dst.copy_(src)

    t_pack = median_seconds(native_pack, args.repeats)
    t_native = median_seconds(native_round_trip, args.repeats)
    t_torch = median_seconds(torch_round_trip, args.repeats)
    t_copy = median_seconds(one_memcpy, args.repeats)
    assert pool.allocations() == 1, "the fusion buffer must be allocated once"

    rows = [
        {"path": "native pack", "ms": t_pack * 1e3, "GB/s": nbytes / t_pack / 1e9},
        {"path": "native pack+unpack (scaled)", "ms": t_native * 1e3,
         "GB/s": 2 * nbytes / t_native / 1e9},
        {"path": "torch.cat + copy-back (scaled)", "ms": t_torch * 1e3,
         "GB/s": 2 * nbytes / t_torch / 1e9},
        {"path": "one memcpy of the same bytes", "ms": t_copy * 1e3,
         "GB/s": nbytes / t_copy / 1e9},
    ]
    print_table(rows, ["path", "ms", "GB/s"])
    ratios = {
        "torch_round_trip_over_native_round_trip": t_torch / t_native,
        "native_pack_over_one_memcpy": t_pack / t_copy,
        "native_round_trip_over_two_memcpy": t_native / (2 * t_copy),
    }
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")
    path = write_json("pack_bench", {"tensors": len(grads), "bytes": nbytes, "rows": rows,
                                     "ratios": ratios}, args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
