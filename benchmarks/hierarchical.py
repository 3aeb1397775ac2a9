"""Hierarchical allreduce on a world laid out as 2 hosts x 2 ranks, 64 MB by default.

The four processes run on this one machine but rendezvous as two "hosts", so the engine
takes its multi-host paths. Each configuration is a fresh world; raw gloo `all_reduce` of
the same tensor is measured in every one of them as the baseline:
  flat         engine, hierarchical off (one gloo allreduce over the world)
  hier         hierarchical on (the default): local stages through shared memory
  hier-no-shm  hierarchical on, but no shared memory (RAYTRAIN_X_SHM=0): the hosts vote
               it off and the allreduce goes flat
Real hosts would put the cross stage on a network; here it is loopback as well, so the
figures compare the local stages and the data volume, not a network.

Run: .venv/bin/python benchmarks/hierarchical.py [--mb 64] [--repeats 6]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from common import join_world, median_across_ranks, print_table, run_ranks, write_json

CONFIGS = {
    "flat": {"RAYTRAIN_X_HIERARCHICAL_ALLREDUCE": "0", "RAYTRAIN_X_SHM": "1"},
    "hier": {"RAYTRAIN_X_HIERARCHICAL_ALLREDUCE": "1", "RAYTRAIN_X_SHM": "1"},
    "hier-no-shm": {"RAYTRAIN_X_HIERARCHICAL_ALLREDUCE": "1", "RAYTRAIN_X_SHM": "0"},
}


def _worker(rank: int, size: int, port: int, config: str, nbytes: int, repeats: int,
            queue) -> None:
    import raytrain_x.torch as rx

    per_host = 2
    os.environ.update({"RAYTRAIN_X_LOCAL_RANK": str(rank % per_host),
                       "RAYTRAIN_X_LOCAL_SIZE": str(per_host),
                       "RAYTRAIN_X_CROSS_RANK": str(rank // per_host),
                       "RAYTRAIN_X_CROSS_SIZE": str(size // per_host)})
    join_world(rank, size, port, CONFIGS[config])
    rx.init()
    t = torch.ones(nbytes // 4)
    raw = median_across_ranks(lambda: dist.all_reduce(t), repeats)
    engine = median_across_ranks(lambda: rx.allreduce_(t, op=rx.Sum, name="h"), repeats)
    transport = rx.transport()
    rx.shutdown()
    dist.destroy_process_group()
    if rank == 0:
        queue.put((raw, engine, transport))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    rows = []
    for config in CONFIGS:
        raw, engine, transport = run_ranks(_worker, 4, config, args.mb << 20, args.repeats)
        rows.append({"config": config, "transport": transport, "raw gloo ms": raw * 1e3,
                     "engine ms": engine * 1e3, "engine/raw": engine / raw})
    print(f"4 processes as 2 hosts x 2, {args.mb} MB float32 allreduce")
    print_table(rows, list(rows[0]))
    print(f"wrote {write_json('hierarchical', {'mb': args.mb, 'rows': rows})}")


if __name__ == "__main__":
    main()
