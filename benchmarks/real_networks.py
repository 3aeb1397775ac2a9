"""Throughput of networks whose backward computes, 2 workers on one host (issue 30's
first figures: the baseline before any overlap work).

Workloads (`raytrain_x.torch.workloads`, plain torch, synthetic deterministic data):
  resnet18   ResNet-18 (11.2M parameters) on 64x64 images, SGD with momentum
  gpt        a GPT-style decoder (6 layers, width 512, sequence 128, 23.2M parameters),
             AdamW
Ways, in the same processes, interleaved round by round (--repeats rounds):
  floor      each worker trains on its own (no communication): the compute floor
  ddp<N>     DistributedDataParallel with bucket_cap_mb=N (25 is DDP's default)
  rx         raytrain_x.torch.DistributedOptimizer as the README calls it
Reports samples/s per way (median over rounds, with min-max), the overhead over the floor
and the ratio to DDP's default and to DDP's best bucket. Writes results/real_networks.json.

Run alone: .venv/bin/python benchmarks/real_networks.py [--repeats 5] [--steps 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import join_world, median_across_ranks, print_table, run_ranks, write_json  # noqa: E402

BATCH = {"resnet18": 32, "gpt": 4}  # per worker: a step of 0.2-2 s on this machine


def _workload(name: str):
    from raytrain_x.torch.workloads import (
        GPTDecoder,
        resnet18,
        synthetic_images,
        synthetic_tokens,
    )

    batch = BATCH[name]
    if name == "resnet18":
        def data(rank: int, step: int):
            return synthetic_images(batch, seed=1000 * rank + step)

        return (resnet18, lambda m: torch.optim.SGD(m.parameters(), 0.05, momentum=0.9),
                data, torch.nn.functional.cross_entropy)

    def tokens(rank: int, step: int):
        return synthetic_tokens(batch, seed=1000 * rank + step)

    def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return (GPTDecoder, lambda m: torch.optim.AdamW(m.parameters(), 3e-4), tokens, lm_loss)


def _worker(rank: int, size: int, port: int, args, queue) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import raytrain_x.torch as rx

    join_world(rank, size, port)
    rx.init()
    ways = ["floor", *(f"ddp{b:g}" for b in args.ddp_buckets), "rx"]
    out: dict[str, dict[str, list[float]]] = {}
    for name in args.workloads:
        make_model, make_opt, data, loss_fn = _workload(name)
        out[name] = {w: [] for w in ways}
        for r in range(args.repeats):
            for way in ways:
                model = make_model()
                opt = make_opt(model)
                if way.startswith("ddp"):
                    model = DDP(model, bucket_cap_mb=float(way[3:]))
                    opt = make_opt(model)
                elif way == "rx":
                    opt = rx.DistributedOptimizer(opt, named_parameters=model.named_parameters())
                counter = iter(range(1 << 30))

                def step(model=model, opt=opt, counter=counter) -> None:
                    x, y = data(rank, next(counter))
                    opt.zero_grad()
                    loss_fn(model(x), y).backward()
                    opt.step()

                seconds = median_across_ranks(step, args.steps, warmup=2)
                out[name][way].append(BATCH[name] * size / seconds)
                if rank == 0:
                    print(f"{name} round {r + 1}/{args.repeats} {way}: "
                          f"{BATCH[name] * size / seconds:.1f} samples/s "
                          f"({seconds:.3f} s/step)", flush=True)
    if rank == 0:
        queue.put(out)
    rx.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["resnet18", "gpt"],
                        choices=sorted(BATCH))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per way and round")
    parser.add_argument("--ddp-buckets", type=float, nargs="+", default=[25.0, 5.0, 100.0])
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    started = time.monotonic()
    out = run_ranks(_worker, args.workers, args)
    rows, payload = [], {"workers": args.workers, "repeats": args.repeats,
                         "steps": args.steps, "batch_per_worker": BATCH, "results": {}}
    for name, ways in out.items():
        med = {w: statistics.median(v) for w, v in ways.items()}
        ddps = {w: m for w, m in med.items() if w.startswith("ddp")}
        best_ddp = max(ddps, key=ddps.get)
        for way, values in ways.items():
            rows.append({"workload": name, "way": way, "samples/s": med[way],
                         "min": min(values), "max": max(values),
                         "vs floor": med[way] / med["floor"],
                         "vs ddp25": med[way] / med["ddp25"],
                         "vs best ddp": med[way] / med[best_ddp]})
        payload["results"][name] = {"samples_per_s": ways, "median": med,
                                    "best_ddp": best_ddp}
    print_table(rows, ["workload", "way", "samples/s", "min", "max", "vs floor", "vs ddp25",
                       "vs best ddp"])
    payload["seconds"] = round(time.monotonic() - started, 1)
    print(f"wrote {write_json('real_networks', payload)}")


if __name__ == "__main__":
    main()
