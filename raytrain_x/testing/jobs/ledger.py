"""The step ledger of an elastic job, and the checks every elastic job must pass: each
committed step done exactly once on every rank, each epoch's samples seen once, equal
weights at the end.

A ledger job (`raytrain_x.testing.jobs.torch_ledger.ledger_train`, or the Keras face's
`raytrain_x.testing.jobs.keras_ledger.keras_ledger_train`) records every step it commits in its
elastic state and returns the ledger; `ledger_errors` judges what the ranks returned. The
elastic tests, the multi-host drivers and the chaos soak (`tools/chaos.py`) use them,
and so can anyone who wants to see a cluster's faults survived:

    results = executor.run(ledger_train, args=(200,), kwargs={"progress": path})
    assert ledger_errors(results, steps=200) == []
"""

from __future__ import annotations

import os
from typing import Any

SAMPLES = 64  # the ElasticSampler's dataset: indices 0..SAMPLES-1, one per rank and step


def write_progress(path: str, step: int, size: int) -> None:
    """Rank 0's "step size" line, replaced atomically (a reader never sees half of it)."""
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{step} {size}")
    os.replace(tmp, path)


def read_progress(path: Any) -> tuple[int, int]:
    """(step, size) from a progress file; (0, 0) before the first commit."""
    try:
        with open(path) as f:
            step, size = map(int, f.read().split())
        return step, size
    except (OSError, ValueError):
        return 0, 0


def ledger_errors(ranks: list[dict], steps: int | None = None,
                  samples: int = SAMPLES) -> list[str]:
    """What the ranks' ledgers break, a line each (empty: every invariant holds).

    Every rank committed steps 0..n-1 once each (n = `steps` when given, else the ranks'
    agreed count); every epoch a rank finished saw each of `samples` once, and the epoch
    under way no sample twice; every rank ends with the same weights (and, for a sharded
    optimizer, with every parameter's optimizer step count equal to the steps)."""
    if not ranks:
        return ["no rank finished"]
    errors = []
    n = steps if steps is not None else ranks[0]["step"]
    for r in ranks:
        ledger = r["done_steps"]
        if ledger != list(range(n)):
            lost = sorted(set(range(n)) - set(ledger))
            doubled = sorted({s for s in ledger if ledger.count(s) > 1})
            extra = sorted(s for s in set(ledger) if s >= n)
            errors.append(f"rank {r['rank']}: committed steps lost {lost[:10]}, doubled "
                          f"{doubled[:10]}, beyond {n}: {extra[:10]}")
        if "seen" in r:
            # epochs in order: keys are ints, or strings once the ranks came through JSON
            *finished, (_, current) = sorted(r["seen"].items(), key=lambda kv: int(kv[0]))
            for epoch, seen in finished:
                if sorted(seen) != list(range(samples)):
                    errors.append(f"rank {r['rank']}: epoch {epoch} did not see each sample "
                                  "once")
            if len(set(current)) != len(current):
                errors.append(f"rank {r['rank']}: a sample twice in the epoch under way")
    if any(r["weight"] != ranks[0]["weight"] for r in ranks):
        errors.append("the ranks' weights differ")
    for r in ranks:
        if "optimizer_steps" in r and r["optimizer_steps"] != [n]:
            errors.append(f"rank {r['rank']}: the optimizer's step counts are "
                          f"{r['optimizer_steps']}, not [{n}]: its state was not the "
                          "committed one")
    return errors
