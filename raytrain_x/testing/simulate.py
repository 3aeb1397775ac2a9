"""Simulated elastic jobs: `python -m raytrain_x.testing.simulate --schedules N --seed S`.

Runs the real elastic controller through N random fault schedules (seeds S, S+1, ...) on
a virtual clock, checking every invariant (docs/elastic.md, "Simulation"), then the named
scenarios. Ends with one line, `simulated N schedules (F faults, H virtual hours) in W s:
V violations`, and exits 1 on any violation after printing each failing schedule shrunk
to a minimal one (Hypothesis) with the command that replays it.

One seed is one history: the command runs itself with PYTHONHASHSEED=0, since the
controller iterates sets of worker ids.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from raytrain_x.testing.simulation import Outcome, random_schedule, run_schedule, scenarios
from raytrain_x.testing.simulation.schedules import Fault, Schedule
from raytrain_x.testing.simulation.shrink import shrink

CHUNK = 250  # schedules per task handed to a process


def _run_chunk(args: tuple[int, int, int]) -> dict:
    first, count, faults = args
    out = {"schedules": 0, "faults": 0, "scheduled": 0, "virtual_s": 0.0, "reshards": 0,
           "chunks_lost": 0, "stops": {},
           "failing": [], "recoveries": {}}
    for seed in range(first, first + count):
        schedule = random_schedule(seed, faults=faults)
        outcome = run_schedule(schedule)
        out["scheduled"] += len(schedule.faults)
        _add(out, outcome)
        if not outcome.ok:
            out["failing"].append((seed, outcome.violations[:3]))
    return out


def _add(total: dict, outcome: Outcome) -> None:
    total["schedules"] += 1
    total["faults"] += outcome.faults
    total["virtual_s"] += outcome.virtual_s
    total["reshards"] = total.get("reshards", 0) + outcome.reshards
    total["chunks_lost"] = total.get("chunks_lost", 0) + outcome.chunks_lost
    total["stops"][outcome.stop] = total["stops"].get(outcome.stop, 0) + 1
    for kind, values in outcome.recoveries.items():
        total["recoveries"].setdefault(kind, []).extend(values)


def _merge(total: dict, part: dict) -> None:
    for key in ("schedules", "faults", "scheduled", "virtual_s", "reshards", "chunks_lost"):
        total[key] = total.get(key, 0) + part.get(key, 0)
    for stop, n in part["stops"].items():
        total["stops"][stop] = total["stops"].get(stop, 0) + n
    total["failing"] += part["failing"]
    for kind, values in part["recoveries"].items():
        total["recoveries"].setdefault(kind, []).extend(values)


def _chunks(seed: int, schedules: int, faults: int) -> Iterator[tuple[int, int, int]]:
    for first in range(seed, seed + schedules, CHUNK):
        yield first, min(CHUNK, seed + schedules - first), faults


def _replay_line(schedule: Schedule) -> str:
    if schedule.name:
        return f"python -m raytrain_x.testing.simulate --scenario {schedule.name} --trace"
    return f"python -m raytrain_x.testing.simulate --replay {schedule.seed} --trace"


def _report_failure(schedule: Schedule, violations: list[str], minimal: bool) -> None:
    print(f"\nVIOLATION in {schedule.name or f'seed {schedule.seed}'}:", flush=True)
    for v in violations[:5]:
        print(f"  {v}")
    if minimal:
        small = shrink(schedule)
        print(f"shrunk from {len(schedule.faults)} to {len(small.faults)} faults:")
        print(small.describe())
        only = json.dumps([[f.at, f.kind, f.pick, f.value] for f in small.faults])
        print(f"replay: {_replay_line(schedule)} --only '{only}'", flush=True)
    else:
        print(f"replay: {_replay_line(schedule)}", flush=True)


def _percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    q = statistics.quantiles(values, n=20, method="inclusive") if len(values) > 1 \
        else [values[0]] * 19
    return f"n={len(values)} median {statistics.median(values):.2f}s p95 {q[18]:.2f}s " \
           f"max {max(values):.2f}s"


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "raytrain_x.testing.simulate",
                                  *(sys.argv[1:] if argv is None else argv)])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0, help="the first schedule's seed")
    parser.add_argument("--faults", type=int, default=20, help="faults per schedule, at least")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="processes to run schedules in")
    parser.add_argument("--no-scenarios", action="store_true",
                        help="skip the named scenarios")
    parser.add_argument("--scenario", help="run one named scenario (see --list)")
    parser.add_argument("--replay", type=int, help="run the schedule of one seed")
    parser.add_argument("--only", help="with --replay: only these faults, as the JSON a "
                        "shrunk schedule prints")
    parser.add_argument("--trace", action="store_true", help="print the history")
    parser.add_argument("--list", action="store_true", help="list the named scenarios")
    parser.add_argument("--no-shrink", action="store_true")
    parser.add_argument("--json", help="write the totals and recovery times here")
    args = parser.parse_args(argv)
    named = scenarios()
    if args.list:
        for name, schedule in named.items():
            print(f"{name}: {schedule.notes[0]}")
        return 0
    if args.scenario is not None or args.replay is not None:
        schedule = named[args.scenario] if args.scenario else \
            random_schedule(args.replay, faults=args.faults)
        if args.only:
            schedule = replace(schedule, faults=tuple(Fault(*f) for f in json.loads(args.only)))
        print(schedule.describe())
        outcome = run_schedule(schedule, keep_trace=args.trace)
        if args.trace:
            print("\n".join(outcome.trace))
        print(f"stop: {outcome.stop}; {outcome.commits} commits in {outcome.virtual_s:.1f} "
              f"virtual s; violations: {outcome.violations or 'none'}")
        return 0 if outcome.ok else 1
    began = time.monotonic()
    total = {"schedules": 0, "faults": 0, "scheduled": 0, "virtual_s": 0.0, "stops": {},
             "failing": [], "recoveries": {}}
    chunks = list(_chunks(args.seed, args.schedules, args.faults))
    done_at = time.monotonic()
    if args.jobs > 1 and len(chunks) > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            for part in pool.map(_run_chunk, chunks):
                _merge(total, part)
                done_at = _progress(total, args.schedules, began, done_at)
    else:
        for chunk in chunks:
            _merge(total, _run_chunk(chunk))
            done_at = _progress(total, args.schedules, began, done_at)
    failing_named = []
    if not args.no_scenarios:
        for schedule in named.values():
            outcome = run_schedule(schedule)
            _add(total, outcome)
            if not outcome.ok:
                failing_named.append((schedule, outcome.violations))
    for seed, violations in total["failing"][:3]:
        _report_failure(random_schedule(seed, faults=args.faults), violations,
                        not args.no_shrink)
    if len(total["failing"]) > 3:
        print(f"\n... and {len(total['failing']) - 3} more failing seeds: "
              f"{[s for s, _ in total['failing'][3:20]]}")
    for schedule, violations in failing_named:
        _report_failure(schedule, violations, False)
    violations = len(total["failing"]) + len(failing_named)
    print(f"\n{total['scheduled']} faults scheduled in the random schedules; the counts "
          "below are those that met a running job (a job that stops with a documented "
          "stop meets no more)")
    print("stops: " + ", ".join(f"{k} {v}" for k, v in sorted(total["stops"].items())))
    print("recovery, fault to the next commit of a new round (virtual):")
    for kind, values in sorted(total["recoveries"].items()):
        print(f"  {kind:24s} {_percentiles(values)}")
    wall = time.monotonic() - began
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"schedules": total["schedules"], "faults": total["faults"],
                       "faults_scheduled": total["scheduled"],
                       "virtual_hours": total["virtual_s"] / 3600, "wall_s": wall,
                       "violations": violations, "stops": total["stops"],
                       "reshards_checked": total.get("reshards", 0),
                       "reshards_with_a_chunk_lost": total.get("chunks_lost", 0),
                       "failing_seeds": [s for s, _ in total["failing"]],
                       "recovery": {k: {"n": len(v), "median": statistics.median(v),
                                        "max": max(v)}
                                    for k, v in total["recoveries"].items() if v}}, f, indent=1)
    print(f"re-shards of the model's chunks planned and checked: {total.get('reshards', 0)} "
          f"({total.get('chunks_lost', 0)} found a chunk with no copy)", flush=True)
    print(f"simulated {total['schedules']} schedules ({total['faults']} faults, "
          f"{total['virtual_s'] / 3600:.1f} virtual hours) in {wall:.0f} s: "
          f"{violations} violations", flush=True)
    return 1 if violations else 0


def _progress(total: dict, planned: int, began: float, last: float) -> float:
    now = time.monotonic()
    if now - last < 10 and total["schedules"] < planned:
        return last
    print(f"  {total['schedules']}/{planned} schedules, {len(total['failing'])} failing, "
          f"{now - began:.0f} s", flush=True)
    return now


if __name__ == "__main__":
    sys.exit(main())
