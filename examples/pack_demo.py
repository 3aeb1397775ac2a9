"""Packs a ResNet-50-shaped gradient set into a persistent fusion buffer and back.

Prints the throughput of the native core next to torch.cat + copy-back.
Run: .venv/bin/python examples/pack_demo.py
"""

from __future__ import annotations

import time

import torch

from raytrain_x.common.workloads import resnet50_parameter_shapes
from raytrain_x.engine import FusionBufferPool, pack, unpack


def main(steps: int = 20) -> None:
    grads = [torch.randn(s) for s in resnet50_parameter_shapes()]
    nbytes = sum(g.numel() for g in grads) * 4
    pool = FusionBufferPool()
    buffer = pool.get(torch.float32, nbytes)
    print(f"{len(grads)} gradients, {nbytes / 2**20:.0f} MiB, fusion buffer at "
          f"0x{buffer.address:x} ({buffer.capacity_bytes / 2**20:.0f} MiB)")
    start = time.perf_counter()
    for step in range(steps):
        pack(grads, buffer, prescale=0.5)  # e.g. Average over 2 ranks, applied while copying
        unpack(buffer, grads, postscale=2.0)
        if step % 5 == 4:
            rate = 2 * nbytes * (step + 1) / (time.perf_counter() - start) / 1e9
            print(f"step {step + 1}/{steps}: native pack+unpack {rate:.1f} GB/s")
    native = time.perf_counter() - start
    sizes = [g.numel() for g in grads]
    start = time.perf_counter()
    for _ in range(steps):
        flat = torch.cat([g.view(-1) for g in grads])
        for g, chunk in zip(grads, flat.split(sizes)):
            g.copy_(chunk.view_as(g))
    baseline = time.perf_counter() - start
    print(f"native {native / steps * 1e3:.1f} ms/step, torch.cat + copy-back "
          f"{baseline / steps * 1e3:.1f} ms/step ({baseline / native:.1f}x slower); "
          f"buffer allocations: {pool.allocations()}")


if __name__ == "__main__":
    main()
