"""Driver scripts the multi-host tests run on host 0 of an emulated cluster.

    python -m tests.emulated_jobs elastic --progress F --stop F --out F [--timeout S]
    python -m tests.emulated_jobs fixed --progress F --out F [--timeout S]

`elastic`: an elastic job (min 2, max 4 workers, one per CPU) that runs the ledger job
(`raytrain_x.testing.jobs.torch_ledger`) until the stop file appears, rank 0 writing
"step size" to the progress file at every commit; it writes what was committed, the sizes
and the round history to --out as JSON.
`fixed`: a 2 hosts x 2 workers job that allreduces until a collective fails; --out gets the
error and how long after the last good step it came.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback


def _fixed_train(progress: str) -> None:
    import torch

    import raytrain_x.torch as rx

    rx.init()
    t = torch.ones(1000)
    step = 0
    while True:
        rx.allreduce_(t, op=rx.Average, name="g")
        step += 1
        if rx.rank() == 0 and step % 10 == 0:
            with open(progress, "w") as f:
                f.write(f"{step} {time.time()}")
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["elastic", "fixed"])
    parser.add_argument("--progress", required=True)
    parser.add_argument("--stop", default="")
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--cooldown", type=float, default=20.0)
    args = parser.parse_args()

    import ray

    from raytrain_x.ray import RayExecutor

    ray.init(log_to_driver=False)
    settings = RayExecutor.create_settings(timeout_s=args.timeout)
    out: dict = {}
    if args.mode == "elastic":
        ex = RayExecutor(settings, min_workers=2, max_workers=4, cpus_per_worker=1,
                         cooldown_range=(args.cooldown, args.cooldown))
        ex.start()
        try:
            from raytrain_x.testing.jobs.torch_ledger import ledger_train

            out["results"] = ex.run(ledger_train, kwargs={"stop": args.stop,
                                                          "progress": args.progress})
            out["history"] = ex.elastic_history
        finally:
            ex.shutdown()
    else:
        ex = RayExecutor(settings, num_hosts=2, num_workers_per_host=2, cpus_per_worker=1)
        ex.start()
        try:
            ex.run(_fixed_train, args=[args.progress])
        except Exception as exc:  # noqa: BLE001 - the test reads what it was
            out = {"type": type(exc).__name__, "error": str(exc), "at": time.time(),
                   "traceback": traceback.format_exc()}
        finally:
            ex.shutdown()
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
