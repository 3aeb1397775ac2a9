"""Allreduce sweep, 4 B to 256 MB: raw torch.distributed vs the raytrain-x engine.

Same processes, same tensors, alternating per size. Prints time, algbw and busbw
(nccl-tests formulas: algbw = bytes / time, busbw = algbw * 2(n-1)/n) and the ratio
engine / raw. Writes results/allreduce_sweep_<n>w.json.

Run: .venv/bin/python benchmarks/allreduce_sweep.py [--workers 2 3] [--max-mb 256]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port, join_world, median_across_ranks, print_table, write_json  # noqa: E402


def _worker(rank: int, size: int, port: int, sizes: list[int], queue) -> None:
    import raytrain_x.torch as rx

    join_world(rank, size, port)
    rx.init()
    rows = []
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4))
        repeats = 50 if nbytes <= 1 << 20 else 10 if nbytes <= 32 << 20 else 4
        raw = median_across_ranks(lambda: dist.all_reduce(t), repeats)
        engine = median_across_ranks(
            lambda: rx.allreduce_(t, op=rx.Sum, name=f"sweep{nbytes}"), repeats)
        rows.append((t.numel() * 4, raw, engine))
    rx.shutdown()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(rows)


def _human(nbytes: int) -> str:
    for unit in ("B", "KB", "MB"):
        if nbytes < 1024:
            return f"{nbytes}{unit}"
        nbytes //= 1024
    return f"{nbytes}GB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--max-mb", type=int, default=256)
    args = parser.parse_args()
    sizes = [4 << (2 * i) for i in range(20) if 4 << (2 * i) <= args.max_mb << 20]
    for n in args.workers:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, n, port, sizes, queue)) for r in range(n)]
        for p in procs:
            p.start()
        rows = queue.get(timeout=3600)
        for p in procs:
            p.join()
        table = []
        for nbytes, raw, engine in rows:
            bus = 2 * (n - 1) / n
            table.append({"size": _human(nbytes), "raw ms": raw * 1e3, "engine ms": engine * 1e3,
                          "raw busbw GB/s": nbytes / raw * bus / 1e9,
                          "engine busbw GB/s": nbytes / engine * bus / 1e9,
                          "engine/raw": engine / raw})
        print(f"\n{n} workers (gloo, loopback)")
        print_table(table, list(table[0]))
        write_json(f"allreduce_sweep_{n}w", {"workers": n, "rows": [
            {"bytes": b, "raw_s": r, "engine_s": e, "algbw_raw": b / r, "algbw_engine": b / e}
            for b, r, e in rows]})


if __name__ == "__main__":
    main()
