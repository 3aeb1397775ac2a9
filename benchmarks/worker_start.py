"""How long a raytrain-x worker actor takes to start: from `Worker.remote()` to its first
answer, on a fresh local Ray node (no dashboard).

Measures the first start (a cold worker process that imports raytrain-x, torch included),
later starts one at a time, and three at once (the elastic scale-up of issue 18). This is
the time the elastic driver must wait for before it may call a worker stuck; see
docs/elastic.md. Writes results/worker_start.json.

Run alone: .venv/bin/python benchmarks/worker_start.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import print_table, write_json


def _start(workers: int) -> float:
    """Seconds until `workers` new worker actors have all answered; then they are killed."""
    import ray

    from raytrain_x.ray.worker import Worker

    began = time.perf_counter()
    actors = [Worker.options(num_cpus=1).remote() for _ in range(workers)]
    ray.get([a.node_id.remote() for a in actors])
    seconds = time.perf_counter() - began
    print(f"{workers} worker(s) started in {seconds:.2f} s", flush=True)
    for a in actors:
        ray.kill(a, no_restart=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import ray

    began = time.perf_counter()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    ray_start = time.perf_counter() - began
    try:
        first = _start(1)
        later = [_start(1) for _ in range(args.repeats)]
        three = [_start(3) for _ in range(args.repeats)]
    finally:
        ray.shutdown()
    result = {"ray_init_s": ray_start, "first_s": first, "later_s": later,
              "later_median_s": statistics.median(later), "three_at_once_s": three,
              "three_at_once_median_s": statistics.median(three)}
    print_table([{"what": "ray.init (local node)", "seconds": ray_start},
                 {"what": "first worker", "seconds": first},
                 {"what": "later workers, median", "seconds": result["later_median_s"]},
                 {"what": "3 workers at once, median",
                  "seconds": result["three_at_once_median_s"]}],
                ["what", "seconds"])
    print(f"wrote {write_json('worker_start', result, args.json)}")


if __name__ == "__main__":
    main()
