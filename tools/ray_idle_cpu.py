"""CPU that an idle Ray test cluster takes on its own, per process, for the settings the
test session's cluster could use (tests/conftest.py).

For each setting: start a `ray.cluster_utils.Cluster` head as the tests do, connect a
driver, let it settle, then read the CPU time every Ray process spends over a window.
Prints the share of one core per process and in total; writes results/ray_idle_cpu.json.

Run alone: .venv/bin/python tools/ray_idle_cpu.py [--settle 10] [--window 30]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from raytrain_x.testing.processes import cpu_shares, processes, with_descendants
from raytrain_x.testing.results import print_table, write_json

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"

SETTINGS = {
    "default head (dashboard on)": {"num_cpus": 8},
    "include_dashboard=False (the tests before)": {"num_cpus": 8, "include_dashboard": False},
    "+ include_log_monitor=False": {"num_cpus": 8, "include_dashboard": False,
                                    "include_log_monitor": False},
}
def measure(head_args: dict, settle: float, window: float) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, connect=False, head_node_args=head_args)
        ray.init(address=cluster.address, log_to_driver=False)
        time.sleep(settle)
        pids = with_descendants({os.getpid()}, processes()) - {os.getpid()}
        return {f"{label} ({pid})": share
                for pid, (label, share) in cpu_shares(pids, window).items()}
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settle", type=float, default=10.0)
    parser.add_argument("--window", type=float, default=30.0)
    args = parser.parse_args()
    results = {}
    for name, head_args in SETTINGS.items():
        per = measure(head_args, args.settle, args.window)
        results[name] = {"total": sum(per.values()), "processes": per}
        rows = [{"process": k, "% of a core": 100 * v}
                for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v > 0.001]
        print(f"\n{name}: {100 * results[name]['total']:.1f}% of a core in all")
        print_table(rows, ["process", "% of a core"])
    path = write_json(RESULTS_DIR / "ray_idle_cpu.json",
                      {"settle_s": args.settle, "window_s": args.window, "settings": results})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
