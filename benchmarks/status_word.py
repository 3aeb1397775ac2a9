"""The status word's allreduce: recursive doubling against gloo's own ring, N processes.

Every negotiating cycle and-s a few int64 words (the status word and the response cache's
bits) across the world; off one host that is `Group.allreduce_control`. Here N ranks, each
its own process on loopback, make a raytrain-x gloo group (lazily connected pairs, as
every raytrain-x group) and time --reps allreduces of --words int64 words with the op
"band": `allreduce_control` (recursive doubling over gloo's point-to-point messages,
`comm/doubling.py`) and, in the same processes, gloo's own allreduce of the same array
(its ring: 2(N-1) steps in sequence). Each rank's mean seconds an allreduce, the slowest
rank's reported; --repeats runs of each alternate, the median kept.

On a machine with fewer cores than ranks the ranks also wait for a core at each step: the
ring's 2(N-1) wake-ups a rank against doubling's <= log2 N + 2 show in the times as they
would in a network's latency.

Run alone: .venv/bin/python benchmarks/status_word.py [--sizes 2 4 8 16 32] [--plot PNG]
Writes results/status_word.json.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time

from common import print_table, write_json


def _rank(rank: int, size: int, path: str, words: int, reps: int, queue) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from raytrain_x.comm.torch_backend import TorchGroup

    torch.set_num_threads(1)
    group = TorchGroup(dist.FileStore(path, size), rank, size, 60.0, list(range(size)),
                       "127.0.0.1")
    ways = {"doubling": group.allreduce_control, "ring": group.allreduce}
    mine = np.full(words, -1, dtype=np.int64)
    for allreduce in ways.values():  # connects the pairs each way uses
        for _ in range(5):
            allreduce(mine.copy(), "band")
    seconds = {}
    for way, allreduce in ways.items():
        group.barrier()
        began = time.perf_counter()
        for _ in range(reps):
            allreduce(mine.copy(), "band")
        seconds[way] = (time.perf_counter() - began) / reps
    queue.put(seconds)
    group.close()


def measure(size: int, words: int, reps: int) -> dict[str, float]:
    """The slowest rank's mean seconds an allreduce, each way, one run of `size` processes."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    path = tempfile.mktemp(prefix="status_word_store_")
    ranks = [context.Process(target=_rank, args=(r, size, path, words, reps, queue))
             for r in range(size)]
    try:
        for process in ranks:
            process.start()
        results = [queue.get(timeout=600) for _ in ranks]
    finally:
        for process in ranks:
            process.join(30)
            if process.is_alive():
                process.kill()
        if os.path.exists(path):
            os.unlink(path)
    return {way: max(r[way] for r in results) for way in results[0]}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    sizes = [r["ranks"] for r in rows]
    ax.plot(sizes, [r["ring_ms"] for r in rows], "o-", color="tab:red", label="gloo's ring")
    ax.plot(sizes, [r["doubling_ms"] for r in rows], "o-", color="tab:blue",
            label="recursive doubling")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks (processes)")
    ax.set_ylabel("ms per status-word allreduce")
    ax.set_title("The status word, off one host")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--words", type=int, default=17,
                        help="int64 words: the status word and 1,024 cache bits")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    rows = []
    for size in args.sizes:
        runs = [measure(size, args.words, args.reps) for _ in range(args.repeats)]
        ring = statistics.median(r["ring"] for r in runs)
        doubling = statistics.median(r["doubling"] for r in runs)
        log2 = size.bit_length() - 1
        rows.append({"ranks": size, "ring_ms": 1e3 * ring, "doubling_ms": 1e3 * doubling,
                     "doubling_over_ring": doubling / ring, "ring_steps": 2 * (size - 1),
                     "doubling_steps": log2 + (2 if size & (size - 1) else 0)})
        print(rows[-1], flush=True)
    print_table(rows, ["ranks", "ring_ms", "doubling_ms", "doubling_over_ring", "ring_steps",
                       "doubling_steps"])
    print(f"wrote {write_json('status_word', {'args': vars(args), 'rows': rows}, args.json)}")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
