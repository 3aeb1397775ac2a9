"""A negotiating cycle's CPU at scale, with fabricated reports (no processes): what rank 0
and what every other rank spend when each rank reports T new tensors.

Two ways, in this one process:
- replicated (the coordinator as it was, loaded from git at --before): every rank receives
  every rank's report (the allgather), unpickles all N and runs its own coordinator over
  them: O(N x T) on every rank.
- rank 0 coordinates (the engine now): rank 0 receives the N reports (the gather), counts
  identical ones once (an allgather's rows travel beside the report, so ranks that differ
  only in their rows send the same report), runs the coordinator and pickles the decision;
  every other rank frames its report and unpickles the decision: O(T), but the decision
  of a cycle of allgathers carries every rank's rows.

Two kinds of reports: `same` (every rank reports the same allreduces: a first step), and
`differ` (every rank's allgathers have its own row count: before the rows travelled
beside the report no two reports were alike, the coordinator's worst case). The median of
--repeats cycles.

Run: .venv/bin/python benchmarks/negotiation_scale.py [--ranks 64 512 4096] [--tensors 100]
Writes results/negotiation_scale.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import pickle
import subprocess
import sys
import time
from pathlib import Path

from raytrain_x.engine.coordinator import Coordinator, Report, frame_report, group_reports
from raytrain_x.engine.messages import ALLGATHER, ALLREDUCE, Meta

from common import median_seconds, print_table, write_json

ROOT = Path(__file__).resolve().parent.parent


def _old_coordinator(rev: str):
    """The `coordinator` module as it was at `rev`."""
    source = subprocess.run(["git", "show", f"{rev}:raytrain_x/engine/coordinator.py"],
                            cwd=ROOT, check=True, capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("old_coordinator", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_coordinator"] = module  # for its dataclasses and pickle
    exec(compile(source, "old_coordinator.py", "exec"), module.__dict__)  # noqa: S102
    return module


def _requests(rank: int, tensors: int, kind: str) -> list[tuple[str, Meta]]:
    if kind == "same":
        return [(f"grad.layer{i}.weight", Meta(ALLREDUCE, "float32", (256, 64 + i), "sum"))
                for i in range(tensors)]
    return [(f"rows.{i}", Meta(ALLGATHER, "float32", (1 + rank + i, 16)))
            for i in range(tensors)]


def cycle_cost(ranks: int, tensors: int, kind: str, old, repeats: int) -> dict:
    members = list(range(ranks))
    # what each way sends: the replicated way's reports carry their rank
    own = [pickle.dumps(old.Report(r, _requests(r, tensors, kind))) for r in members]
    sent = [frame_report(Report(-1, _requests(r, tensors, kind))) for r in members]

    def replicated():  # every rank
        old.Coordinator(lambda _: members).process([pickle.loads(b) for b in own])

    answer = []

    def coordinating():  # rank 0
        coordinator = Coordinator(lambda _: members)
        decision = coordinator.process_grouped(group_reports(sent))
        answer[:] = [pickle.dumps((decision, coordinator.joined))]

    coordinating()
    mine = _requests(ranks - 1, tensors, kind)

    def other():  # every rank but 0
        frame_report(Report(-1, mine))
        pickle.loads(answer[0])

    return {"ranks": ranks, "tensors": tensors, "reports": kind,
            "replicated_every_rank_s": _cpu(replicated, repeats),
            "coordinator_s": _cpu(coordinating, repeats),
            "other_rank_s": _cpu(other, repeats)}


def _cpu(fn, repeats: int) -> float:
    """The median CPU seconds of `fn`, every run timed."""
    return median_seconds(fn, repeats, warmup=0, clock=time.process_time)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 512, 4096])
    parser.add_argument("--tensors", type=int, default=100)
    parser.add_argument("--kinds", nargs="+", default=["same", "differ"],
                        choices=["same", "differ"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--before", default="3b5629b",
                        help="the commit whose replicated coordinator is the baseline")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    old = _old_coordinator(args.before)
    rows = []
    for kind in args.kinds:
        for ranks in args.ranks:
            rows.append(cycle_cost(ranks, args.tensors, kind, old, args.repeats))
            print(rows[-1], flush=True, file=sys.stderr)
    print_table(rows, ["ranks", "tensors", "reports", "replicated_every_rank_s",
                       "coordinator_s", "other_rank_s"])
    path = write_json("negotiation_scale", {"args": vars(args), "cycles": rows}, args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
