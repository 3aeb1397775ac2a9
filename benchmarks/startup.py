"""Start-up cost of the driver side: how long `import raytrain_x.ray` takes (and what it
loads), and the time from `RayExecutor.start()` to the first completed `run()`.

Each figure comes from fresh interpreters, so nothing is cached in the process. With
`--compare OTHER_PYTHON` the same measurements also run under another interpreter whose
`raytrain_x` is another checkout (say, the code before a change), interleaved round by
round with this one, so both see the same machine load:

    .venv/bin/python benchmarks/startup.py --compare /tmp/before-venv/bin/python

Writes results/startup.json. Run alone (it starts its own local Ray node).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import print_table, write_json

_IMPORT = """
import sys, time
began = time.perf_counter()
import raytrain_x.ray
seconds = time.perf_counter() - began
import json
print(json.dumps({"seconds": seconds, "torch": "torch" in sys.modules,
                  "ray_tune": "ray.tune" in sys.modules,
                  "where": raytrain_x.__file__}))
"""

_FIRST_RUN = """
import json, sys, time
import ray
from raytrain_x.ray import RayExecutor

def train():
    import torch
    import raytrain_x.torch as rx
    rx.init()
    return float(rx.allreduce(torch.ones(4), name="first").sum())

ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
try:
    times = []
    for _ in range(int(sys.argv[1])):
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2,
                               cpus_per_worker=1)
        began = time.perf_counter()
        executor.start()
        result = executor.run(train)
        times.append(time.perf_counter() - began)
        executor.shutdown()
        assert result == [4.0, 4.0], result
finally:
    ray.shutdown()
print(json.dumps({"seconds": times}))
"""


def _run(python: str, code: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    out = subprocess.run([python, "-c", code, *args], capture_output=True, text=True,
                         env=env, timeout=600, cwd="/")
    if out.returncode != 0:
        raise SystemExit(f"{python} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--imports", type=int, default=7, help="fresh imports per interpreter")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of start-to-first-run, each on a fresh Ray node")
    parser.add_argument("--per-round", type=int, default=2,
                        help="executor starts per round (the first one also starts workers' "
                             "Python for the first time)")
    parser.add_argument("--compare", default=None,
                        help="another interpreter to measure the same way (e.g. the code "
                             "before a change)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    pythons = {"this": sys.executable}
    if args.compare:
        pythons["compare"] = args.compare

    imports: dict[str, list[dict]] = {k: [] for k in pythons}
    for i in range(args.imports):
        for label, python in pythons.items():
            imports[label].append(_run(python, _IMPORT))
        print(f"import round {i + 1}/{args.imports}: " + ", ".join(
            f"{k} {v[-1]['seconds']:.2f}s" for k, v in imports.items()), flush=True)
    first_run: dict[str, list[float]] = {k: [] for k in pythons}
    for i in range(args.rounds):
        for label, python in pythons.items():
            first_run[label].extend(_run(python, _FIRST_RUN, str(args.per_round))["seconds"])
        print(f"start-to-first-run round {i + 1}/{args.rounds}: " + ", ".join(
            f"{k} {v[-args.per_round:]}" for k, v in first_run.items()), flush=True)

    result: dict = {"pythons": pythons}
    rows = []
    for label in pythons:
        seconds = [r["seconds"] for r in imports[label]]
        entry = {
            "where": imports[label][0]["where"],
            "import_s": seconds,
            "import_median_s": statistics.median(seconds),
            "import_loads_torch": imports[label][0]["torch"],
            "import_loads_ray_tune": imports[label][0]["ray_tune"],
            "first_run_s": first_run[label],
            "first_run_median_s": statistics.median(first_run[label]),
        }
        result[label] = entry
        rows.append({"code": label, "import s": entry["import_median_s"],
                     "torch": entry["import_loads_torch"],
                     "ray.tune": entry["import_loads_ray_tune"],
                     "start->run s": entry["first_run_median_s"],
                     "from": str(Path(entry["where"]).parent.parent)})
    if "compare" in result:
        result["import_ratio"] = (result["this"]["import_median_s"]
                                  / result["compare"]["import_median_s"])
        result["first_run_ratio"] = (result["this"]["first_run_median_s"]
                                     / result["compare"]["first_run_median_s"])
    print_table(rows, ["code", "import s", "torch", "ray.tune", "start->run s", "from"])
    if "compare" in result:
        print(f"this/compare: import {result['import_ratio']:.2f}x, "
              f"start->first run {result['first_run_ratio']:.2f}x")
    print(f"wrote {write_json('startup', result, args.json)}")


if __name__ == "__main__":
    main()
