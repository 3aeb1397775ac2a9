"""The CPU the elastic trainer's own machinery takes while a run trains, against the
fixed-size trainer's: both fit 2 workers whose loop holds still after `rx.init()` (it
sleeps), so all the CPU measured is the trainer's, raytrain-x's and Ray's own work, none of
it training. On a machine whose cores training fills, that CPU is what the elastic trainer's
step time loses to the fixed one's (benchmarks/ray_train_vs_torch_trainer.py's
`raytrain_x_elastic` against `raytrain_x`).

Each round starts a local Ray node (4 logical CPUs, no dashboard), fits one trainer on a
thread, waits until its world has formed and --settle more seconds, then reads the CPU
seconds of this process (the driver: the elastic trainer's loop runs here) and of every
process below it (Ray's and the workers') over --window seconds. Reported: the share of one
core per kind of process, per trainer, the median over --repeats rounds.

Run alone: .venv/bin/python benchmarks/elastic_trainer_idle_cpu.py [--repeats 3]
Writes results/elastic_trainer_idle_cpu.json.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from raytrain_x.testing.processes import cpu_shares, processes, with_descendants

from common import print_table, write_json

WAYS = {"fixed": 2, "elastic": (2, 2)}


def _loop(config: dict) -> None:
    import time
    from pathlib import Path

    import raytrain_x.torch as rx

    rx.init()
    if rx.rank() == 0:
        Path(config["ready"]).touch()
    time.sleep(config["hold_s"])


def _fit(num_workers, ready: Path, hold_s: float, storage: str) -> None:
    from ray.train import RunConfig, ScalingConfig

    from raytrain_x.ray.train import RaytrainXConfig, RaytrainXTrainer

    RaytrainXTrainer(_loop, train_loop_config={"ready": str(ready), "hold_s": hold_s},
                     raytrain_x_config=RaytrainXConfig(framework="torch"),
                     scaling_config=ScalingConfig(num_workers=num_workers),
                     run_config=RunConfig(storage_path=storage)).fit()


def measure(num_workers, settle: float, window: float) -> dict[str, float]:
    """Share of one core per kind of process while a trainer's world holds still."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready"
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        try:
            errors: list[BaseException] = []

            def fit() -> None:
                try:
                    _fit(num_workers, ready, settle + window + 5, tmp)
                except BaseException as exc:  # noqa: BLE001 - raised below
                    errors.append(exc)

            thread = threading.Thread(target=fit, daemon=True)
            thread.start()
            deadline = time.monotonic() + 300
            while not ready.exists():
                if errors or time.monotonic() > deadline:
                    raise RuntimeError(f"the {num_workers} trainer did not start: {errors}")
                time.sleep(0.1)
            time.sleep(settle)
            shares = cpu_shares(with_descendants({os.getpid()}, processes()), window)
            thread.join()
            if errors:
                raise errors[0]
        finally:
            ray.shutdown()
    per: dict[str, float] = collections.defaultdict(float)
    for pid, (label, share) in shares.items():
        per["this process (the driver)" if pid == os.getpid() else label] += share
    return dict(per)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settle", type=float, default=5.0)
    parser.add_argument("--window", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rounds: dict[str, list[dict[str, float]]] = {w: [] for w in WAYS}
    for i in range(args.repeats):
        for way, workers in WAYS.items():
            rounds[way].append(measure(workers, args.settle, args.window))
            print(f"round {i + 1}/{args.repeats} {way}: "
                  f"{100 * sum(rounds[way][-1].values()):.1f}% of a core", flush=True)
    labels = sorted({k for rs in rounds.values() for r in rs for k in r})
    median = {w: {k: statistics.median(r.get(k, 0.0) for r in rs) for k in labels}
              for w, rs in rounds.items()}
    rows = [{"process": k, **{f"{w} % of a core": 100 * median[w][k] for w in WAYS}}
            for k in sorted(labels, key=lambda k: -max(m[k] for m in median.values()))
            if max(m[k] for m in median.values()) > 0.001]
    totals = {w: statistics.median(sum(r.values()) for r in rs) for w, rs in rounds.items()}
    rows.append({"process": "all", **{f"{w} % of a core": 100 * totals[w] for w in WAYS}})
    print_table(rows, ["process"] + [f"{w} % of a core" for w in WAYS])
    path = write_json("elastic_trainer_idle_cpu",
                      {"settle_s": args.settle, "window_s": args.window,
                       "repeats": args.repeats, "median": median, "totals": totals,
                       "rounds": rounds})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
