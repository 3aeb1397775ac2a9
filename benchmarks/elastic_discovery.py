"""Horovod's hosts changing under a running job: time from a discovery change to the new
world's first step, and how long the survivors stood still meanwhile.

A local Ray cluster (`ray.cluster_utils.Cluster`: a head that runs no workers and two
2-slot nodes), a discovery script that prints the hosts of a file, RayExecutor(min_workers=1,
max_workers=4) training the elastic benchmark job (`elastic_recovery._train`, ~3M
parameters, a commit every step) on the first host. Then, each repeat:
  add      the second host written into the file: its two workers start and join (in one
           round); time from the write to the first step with 4 workers
  remove   the second host taken out of the file: its workers leave at their next commit;
           time from the write to the first step with 2 workers
For each, the survivors' stall: the longest gap between rank 0's consecutive steps from the
change to the new world's first step (the step time itself included). Horovod stops every
worker at the rendezvous as soon as it sees a change and waits there for the newcomers to
start, so its stall on an add is the whole time to the new world at least; `stall /
to new world` is how much of that time the survivors here did not train.

Run: .venv/bin/python benchmarks/elastic_recovery.py --discovery [--repeats 3]
(results/elastic_discovery.json)
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import ray
from elastic_recovery import _steps, _train

from common import print_table, write_json

SLOT = "rtx_bench_host"  # one per worker slot of a node


def _stall(steps: list[tuple[float, int, int]], t0: float, t1: float) -> float:
    """The longest gap between rank 0's consecutive steps that ends in (t0, t1]."""
    times = [t for t, _, _ in steps]
    gaps = [b - a for a, b in zip(times, times[1:]) if t0 < b <= t1]
    return max(gaps, default=0.0)


def _change(progress: Path, hosts: Path, text: str, size: int) -> tuple[float, float]:
    """Writes the hosts; returns (seconds to the first step in a world of `size`, stall)."""
    t0 = time.time()
    hosts.write_text(text)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        steps = _steps(progress)
        after = [t for t, _, n in steps if t > t0 and n == size]
        if after:
            return after[0] - t0, _stall(steps, t0, after[0])
        time.sleep(0.05)
    raise TimeoutError(f"no step with {size} workers within 120 s of the change")


def measure(repeats: int) -> dict[str, list[float]]:
    from ray.cluster_utils import Cluster

    from raytrain_x.ray import RayExecutor

    out: dict[str, list[float]] = {"add": [], "add_stall": [], "remove": [],
                                   "remove_stall": []}
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False})
    try:
        a = cluster.add_node(num_cpus=2, resources={SLOT: 2})
        b = cluster.add_node(num_cpus=2, resources={SLOT: 2})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent)}})
        with tempfile.TemporaryDirectory() as tmp:
            tmp_path = Path(tmp)
            hosts, progress, until = tmp_path / "hosts", tmp_path / "p.txt", tmp_path / "stop"
            one, both = f"{a.node_id}:2\n", f"{a.node_id}:2\n{b.node_id}:2\n"
            hosts.write_text(one)
            script = tmp_path / "discover.sh"
            script.write_text(f"#!/bin/sh\ncat {hosts}\n")
            script.chmod(0o755)
            executor = RayExecutor(RayExecutor.create_settings(timeout_s=20), min_workers=1,
                                   max_workers=4, cpus_per_worker=1,
                                   resources_per_worker={SLOT: 1},
                                   host_discovery_script=str(script))
            executor.start()
            job = threading.Thread(target=executor.run, daemon=True, args=(_train,), kwargs={
                "args": (str(progress), None, True, str(until))})
            job.start()
            try:
                while sum(1 for _, _, n in _steps(progress) if n == 2) < 10:
                    time.sleep(0.1)
                for i in range(repeats):
                    for way, text, size in (("add", both, 4), ("remove", one, 2)):
                        seconds, stall = _change(progress, hosts, text, size)
                        out[way].append(seconds)
                        out[f"{way}_stall"].append(stall)
                        time.sleep(3)  # a few steps in the new world before the next change
                    print(f"repeat {i + 1}/{repeats}: add {out['add'][-1]:.2f}s (stall "
                          f"{out['add_stall'][-1]:.2f}s), remove {out['remove'][-1]:.2f}s "
                          f"(stall {out['remove_stall'][-1]:.2f}s)", flush=True)
            finally:
                until.touch()
                job.join(120)
                executor.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    return out


def run(repeats: int, json_path: str | None) -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    runs = measure(repeats)
    medians = {k: statistics.median(v) for k, v in runs.items()}
    print_table([{"discovery change": way, "to new world s": medians[way],
                  "survivors' stall s": medians[f"{way}_stall"]} for way in ("add", "remove")],
                ["discovery change", "to new world s", "survivors' stall s"])
    ratio = medians["add_stall"] / medians["add"]
    print(f"add: the survivors' stall is {ratio:.2f}x the time to the new world (Horovod "
          "stalls for all of it)")
    payload = {"runs": runs, "medians": medians, "add_stall_over_add": ratio}
    print(f"wrote {write_json('elastic_discovery', payload, json_path)}")
