"""The elastic simulator at the sizes of large jobs: one schedule (a worker killed, a node
drained, a node added) against the real elastic controller, for N workers on N/8 nodes of
8 slots, N = 64 ... 10,000. Reported per N: the schedule's wall time, its violations, and
the recoveries the simulator models (from the fault to the next commit), with the control
actors modelled as single servers at their measured cost per call (`WorldConfig`), so a
round's formation grows with N as a real one does. The faults come after the job's first
round has formed, spaced by the modelled time a round takes.

Run alone: .venv/bin/python benchmarks/simulated_scale.py [--workers 64 1024 10000]
    [--plot docs/images/simulated_scale.png]
Writes results/simulated_scale.json; --plot: the modelled recoveries against N, with the
measured round formations of results/control_plane.json beside them where that exists.
"""

from __future__ import annotations

import argparse
import time

from common import print_table, write_json


def one(workers: int) -> dict:
    from raytrain_x.testing.simulation.model import STORE_CALLS_PER_MEMBER, WorldConfig
    from raytrain_x.testing.simulation.runner import run_schedule
    from raytrain_x.testing.simulation.schedules import Fault, Schedule

    nodes = max(1, workers // 8)
    config = WorldConfig(nodes=nodes, slots=8, max_nodes=nodes + 4, min_workers=1,
                         max_workers=workers + 32, timeout_s=30.0, commit_s=2.0,
                         autoscaler=False, respawn=False)
    # a round's modelled formation: every member's join and store calls, one at a time
    forming = nodes * 8 * (config.join_call_s + STORE_CALLS_PER_MEMBER * config.store_call_s)
    gap = 20.0 + 2 * forming
    first = 20.0 + 1.5 * forming
    schedule = Schedule(0, config, (Fault(first, "kill_worker", 0.3),
                                    Fault(first + gap, "drain", 0.6, -1.0),
                                    Fault(first + 2 * gap, "add_node", 0.0)), tail_s=gap)
    began = time.perf_counter()
    outcome = run_schedule(schedule)
    return {"workers": nodes * 8, "wall_s": time.perf_counter() - began,
            "modelled_round_s": forming,
            "stop": outcome.stop, "violations": len(outcome.violations),
            **{f"{kind}_s": times[0] for kind, times in outcome.recoveries.items()}}


def plot(rows: list[dict], measured: list[dict], path: str) -> None:
    """Modelled recoveries against N, and the measured formations of real rounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for kind, label, color in (("kill_worker_s", "a worker killed", "tab:red"),
                               ("drain_s", "a node drained", "tab:orange"),
                               ("add_node_s", "a node added", "tab:green")):
        points = [(r["workers"], r[kind]) for r in rows if r.get(kind) is not None]
        if points:
            ax.plot(*zip(*points), "o-", color=color, label=f"modelled: {label}")
    if measured:
        ax.plot([m["workers"] for m in measured], [m["round_s"] for m in measured], "s--",
                color="tab:blue", label="measured: a round forms (control_plane.py)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers")
    ax.set_ylabel("seconds to the next commit / to form")
    ax.set_title("Recovery against job size (simulator, real controller)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+",
                        default=[64, 256, 1_024, 4_096, 10_000])
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    rows = []
    for workers in args.workers:
        rows.append(one(workers))
        print(rows[-1], flush=True)
    print_table(rows, ["workers", "wall_s", "stop", "violations", "modelled_round_s",
                       "kill_worker_s", "drain_s", "add_node_s"])
    print(f"wrote {write_json('simulated_scale', {'args': vars(args), 'rows': rows}, args.json)}")
    if args.plot:
        import json

        from common import RESULTS_DIR

        measured_path = RESULTS_DIR / "control_plane.json"
        measured = [r for r in json.loads(measured_path.read_text()).get("rounds", [])
                    if r["way"] == "lazy"] if measured_path.exists() else []
        plot(rows, measured, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
