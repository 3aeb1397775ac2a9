"""What a worker actor does when its node's raylet is killed: on a local two-node Ray cluster
(default health checks), a raytrain-x worker actor on the second node is asked
`WorkerActor.joining` every 0.5 s (the elastic driver's heartbeat) from before the raylet's
SIGKILL until Ray declares the node dead. Prints when the worker process went (if it did),
when the calls stopped being answered, and when the node was declared dead.

This is why the chaos soak's local raylet kill counts its recovery from the node's removal
(docs/elastic.md, Chaos soak): until then the node's workers train on.

Run alone: .venv/bin/python tools/raylet_kill.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path

from raytrain_x.testing.results import write_json

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def one_kill(limit_s: float = 60.0) -> dict:
    """One cluster, one raylet kill: seconds from the kill to each thing seen."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raytrain_x.ray.worker import Worker

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp = tempfile.mkdtemp(prefix="rtxkill", dir="/tmp")
    cluster = Cluster(initialize_head=False, connect=False)
    seen: dict = {"last_answer_s": None, "process_gone_s": None, "call_failed_s": None,
                  "node_dead_s": None}
    try:
        cluster.add_node(num_cpus=1, include_dashboard=False, temp_dir=temp)
        node = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        worker = Worker.options(num_cpus=1, scheduling_strategy=NodeAffinitySchedulingStrategy(
            node.node_id, soft=False)).remote()
        pid = ray.get(worker.pid.remote())
        began = time.monotonic()
        os.kill(node.all_processes["raylet"][0].process.pid, signal.SIGKILL)
        calls: list = []
        while time.monotonic() - began < limit_s:
            now = time.monotonic() - began
            if seen["process_gone_s"] is None and not _alive(pid):
                seen["process_gone_s"] = now
            calls.append(worker.heartbeat.remote())
            ready, _ = ray.wait(calls, num_returns=len(calls), timeout=0)
            for ref in ready:
                calls.remove(ref)
                try:
                    ray.get(ref)
                    seen["last_answer_s"] = time.monotonic() - began
                except Exception as exc:  # noqa: BLE001 - the error is what is measured
                    if seen["call_failed_s"] is None:
                        seen["call_failed_s"] = time.monotonic() - began
                        seen["error"] = type(exc).__name__
            if not any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()):
                seen["node_dead_s"] = time.monotonic() - began
                break
            time.sleep(0.5)
        seen["process_alive_at_end"] = _alive(pid)
        if seen["process_alive_at_end"]:
            os.kill(pid, signal.SIGKILL)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    runs = []
    for i in range(args.repeats):
        seen = one_kill()
        runs.append(seen)
        print(f"raylet kill {i + 1}: " + ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in seen.items()),
            flush=True)
    print(f"wrote {write_json(RESULTS_DIR / 'raylet_kill.json', {'runs': runs})}")


if __name__ == "__main__":
    main()
