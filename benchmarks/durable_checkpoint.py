"""What durable checkpoints cost a training job: the GPT workload with a commit every step,
--workers processes (2), trained for --seconds with and without
`CheckpointConfig(every_s=--every)` to a local storage path, each way in a fresh set of
processes, alternating which goes first over --rounds rounds.

Reported: steps/s of each way (steps completed in the window / the window, the slower
rank), the checkpoints written, the write time and, of it, the checksums and the read-back
against them (rank 0), and the ratio with / without.
Writes results/durable_checkpoint_<device>.json.

Run: .venv/bin/python benchmarks/durable_checkpoint.py [--every 30 --seconds 95]
     [--device cuda --layers 8 --width 1024 --batch 8]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from common import join_world, lm_step, print_table, run_ranks, write_json

WAYS = ("none", "durable")


def _worker(rank: int, size: int, port: int, way: str, storage: str, args, queue) -> None:
    import raytrain_x.torch as rx
    from raytrain_x.common.process import PROCESS
    from raytrain_x.torch.workloads import GPTDecoder, synthetic_tokens

    cuda = args.device == "cuda"
    join_world(rank, size, port, {"RAYTRAIN_X_GPU_OPERATIONS": "gloo"}
               if cuda and size > 1 else None)
    rx.init()
    model = GPTDecoder(layers=args.layers, width=args.width).to(args.device)
    ids, targets = (t.to(args.device) for t in synthetic_tokens(args.batch, seed=rank))
    opt = rx.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4),
                                  named_parameters=model.named_parameters())
    config = (rx.CheckpointConfig(storage, name="bench", every_s=args.every)
              if way == "durable" else None)
    state = rx.elastic.TorchState(model, opt, checkpoint=config, step=0)
    state.sync()  # as `rx.elastic.run` starts: rank 0 takes the writer lease, probes storage

    def train_step() -> None:
        lm_step(model, opt, ids, targets)
        state.step += 1
        state.commit()

    for _ in range(2):
        train_step()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    began = time.perf_counter()
    steps = 0
    while True:  # every rank stops at the same step: rank 0's clock decides
        train_step()
        steps += 1
        done = torch.tensor([float(time.perf_counter() - began >= args.seconds)])
        dist.broadcast(done, 0)
        if done.item():
            break
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - began
    state.finish_writes()
    counters = PROCESS.checkpoints
    out = {"steps_per_s": steps / elapsed, "written": counters.written_count,
           "failed": counters.failed_count, "write_s": counters.last_write_s,
           "checksum_s": counters.last_checksum_s, "verify_s": counters.last_verify_s}
    every = [None] * size
    dist.all_gather_object(every, out)
    if rank == 0:
        queue.put({"steps_per_s": min(o["steps_per_s"] for o in every),
                   "written": every[0]["written"], "failed": sum(o["failed"] for o in every),
                   "write_s": every[0]["write_s"], "checksum_s": every[0]["checksum_s"],
                   "verify_s": every[0]["verify_s"]})
    rx.shutdown()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=30.0, help="seconds between checkpoints")
    parser.add_argument("--seconds", type=float, default=95.0, help="training window per way")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {w: [] for w in WAYS}
    for r in range(args.rounds):
        for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
            with tempfile.TemporaryDirectory(prefix="rtx-durable-") as storage:
                runs[way].append(run_ranks(_worker, args.workers, way, storage, args))
            print(f"round {r + 1}/{args.rounds} {way}: {runs[way][-1]}", flush=True)
    rate = {w: statistics.median(o["steps_per_s"] for o in runs[w]) for w in WAYS}
    print_table([{"way": w, "steps/s": rate[w],
                  "checkpoints": statistics.median(o["written"] for o in runs[w]),
                  "write s": statistics.median(o["write_s"] for o in runs[w]),
                  "checksum s": statistics.median(o["checksum_s"] for o in runs[w]),
                  "read-back s": statistics.median(o["verify_s"] for o in runs[w])}
                 for w in WAYS], ["way", "steps/s", "checkpoints", "write s", "checksum s",
                                  "read-back s"])
    ratio = rate["durable"] / rate["none"]
    print(f"throughput with checkpoints every {args.every:g}s / without: {ratio:.3f}")
    payload = {"args": vars(args), "runs": runs, "steps_per_s": rate, "ratio": ratio}
    print(f"wrote {write_json(f'durable_checkpoint_{args.device}', payload, args.json)}")


if __name__ == "__main__":
    main()
