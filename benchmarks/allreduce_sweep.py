"""Allreduce sweep, 4 B to 256 MB: raw torch.distributed vs the raytrain-x engine.

Same processes, same tensors. The engine runs twice: over its shared-memory transport
(the default when every rank is on one host) and with `RAYTRAIN_X_SHM=0` (gloo). Prints
time, algbw and busbw (nccl-tests formulas: algbw = bytes / time, busbw = algbw *
2(n-1)/n) and the ratios engine / raw. Writes results/allreduce_sweep_<n>w.json.

Run: .venv/bin/python benchmarks/allreduce_sweep.py [--workers 2 3] [--max-mb 256]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from common import join_world, median_across_ranks, print_table, run_ranks, write_json


def _worker(rank: int, size: int, port: int, sizes: list[int], queue) -> None:
    import raytrain_x.torch as rx

    join_world(rank, size, port)
    timings: dict[str, list[float]] = {"raw": [], "shm": [], "gloo": []}
    for i, transport in enumerate(("shm", "gloo")):  # the engine over each; raw gloo alongside
        os.environ["RAYTRAIN_X_SHM"] = "1" if transport == "shm" else "0"
        os.environ["RAYTRAIN_X_STORE_PORT"] = str(port + 2 * i)  # a fresh store per init
        rx.init()
        assert rx.transport() == transport, rx.transport()
        for nbytes in sizes:
            t = torch.ones(max(1, nbytes // 4))
            repeats = 50 if nbytes <= 1 << 20 else 10 if nbytes <= 32 << 20 else 4
            if transport == "shm":
                timings["raw"].append(median_across_ranks(lambda: dist.all_reduce(t), repeats))
            timings[transport].append(median_across_ranks(
                lambda: rx.allreduce_(t, op=rx.Sum, name=f"sweep{nbytes}"), repeats))
        rx.shutdown()
    rows = [(max(4, s // 4 * 4), *values)
            for s, values in zip(sizes, zip(timings["raw"], timings["shm"], timings["gloo"]))]
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
        rows = run_ranks(_worker, n, sizes)
        table = []
        bus = 2 * (n - 1) / n
        for nbytes, raw, engine, engine_gloo in rows:
            table.append({"size": _human(nbytes), "raw ms": raw * 1e3, "engine ms": engine * 1e3,
                          "engine(gloo) ms": engine_gloo * 1e3,
                          "raw busbw GB/s": nbytes / raw * bus / 1e9,
                          "engine busbw GB/s": nbytes / engine * bus / 1e9,
                          "engine/raw": engine / raw, "engine(gloo)/raw": engine_gloo / raw})
        print(f"\n{n} workers on one host: raw = torch.distributed gloo all_reduce; engine = "
              "raytrain-x (shared memory); engine(gloo) = raytrain-x with RAYTRAIN_X_SHM=0")
        print_table(table, list(table[0]))
        write_json(f"allreduce_sweep_{n}w", {"workers": n, "rows": [
            {"bytes": b, "raw_s": r, "engine_s": e, "engine_gloo_s": g, "algbw_raw": b / r,
             "algbw_engine": b / e, "algbw_engine_gloo": b / g} for b, r, e, g in rows]})


if __name__ == "__main__":
    main()
