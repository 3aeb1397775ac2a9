"""The elastic simulator at the sizes of large jobs: one schedule (a worker killed, a node
drained, a node added) against the real elastic controller, for N workers on N/8 nodes of
8 slots, N = 64 ... 10,000. Reported per N: the schedule's wall time, its violations, and
the recoveries the simulator models (the store and the connect are instant in its model,
so these say what the controller's own decisions cost, not a real round's formation).

Run alone: .venv/bin/python benchmarks/simulated_scale.py [--workers 64 1024 10000]
Writes results/simulated_scale.json.
"""

from __future__ import annotations

import argparse
import time

from common import print_table, write_json


def one(workers: int) -> dict:
    from raytrain_x.testing.simulation.model import WorldConfig
    from raytrain_x.testing.simulation.runner import run_schedule
    from raytrain_x.testing.simulation.schedules import Fault, Schedule

    nodes = max(1, workers // 8)
    config = WorldConfig(nodes=nodes, slots=8, max_nodes=nodes + 4, min_workers=1,
                         max_workers=workers + 32, timeout_s=30.0, commit_s=2.0,
                         autoscaler=False, respawn=False)
    schedule = Schedule(0, config, (Fault(20.0, "kill_worker", 0.3),
                                    Fault(40.0, "drain", 0.6, -1.0),
                                    Fault(60.0, "add_node", 0.0)), tail_s=10.0)
    began = time.perf_counter()
    outcome = run_schedule(schedule)
    return {"workers": nodes * 8, "wall_s": time.perf_counter() - began,
            "stop": outcome.stop, "violations": len(outcome.violations),
            **{f"{kind}_s": times[0] for kind, times in outcome.recoveries.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+",
                        default=[64, 256, 1_024, 4_096, 10_000])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for workers in args.workers:
        rows.append(one(workers))
        print(rows[-1], flush=True)
    print_table(rows, ["workers", "wall_s", "stop", "violations", "kill_worker_s", "drain_s",
                       "add_node_s"])
    print(f"wrote {write_json('simulated_scale', {'args': vars(args), 'rows': rows}, args.json)}")


if __name__ == "__main__":
    main()
