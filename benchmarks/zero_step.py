"""Sharded optimizer state and gradients on the GPT workload, 2 processes, one way per fresh
pair of processes (so each peak RSS is its own):

  ddp<N>     DistributedDataParallel(bucket_cap_mb=N) with AdamW (each --ddp-buckets size)
  zero_ddp   torch's ZeroRedundancyOptimizer(AdamW) with DDP (25 MB buckets)
  rx0        raytrain-x's DistributedOptimizer(AdamW), unsharded (zero_stage=0)
  rx1, rx2   the same with zero_stage=1 and 2
  rx1_sync   (with --ways) zero_stage=1 stepping every bucket after every reduction
             (`synchronize()` by hand first), against rx1's step of each bucket as its
             reduction lands; rx2_sync likewise

Each times --steps steps after 2 warmup steps (the median, from the slower rank; with
--rounds N, every way N times, interleaved, and the median of the rounds), and
reads what a rank keeps after a step: optimizer-state bytes, gradient bytes, and its peak
memory (resident memory on CPU; with --device cuda the CUDA allocator's peak, both ranks
sharing GPU 0, so every collective runs over gloo: RAYTRAIN_X_GPU_OPERATIONS=gloo).
Prints them with ratios; writes results/zero_step.json (zero_step_cuda.json on CUDA).

Run: .venv/bin/python benchmarks/zero_step.py [--rounds 5] [--steps 8] [--batch 4] [--device cuda]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torch.distributed as dist

from common import (
    join_world,
    median_across_ranks,
    print_table,
    report_slowest,
    run_ranks,
    write_json,
)


def _state_bytes(optimizer) -> int:
    state = optimizer.state
    # a sharded DistributedOptimizer's own
    local = getattr(getattr(optimizer, "reducer", None), "_local", None)
    if local is not None:
        state = local.state
    inner = getattr(optimizer, "optim", None)  # ZeroRedundancyOptimizer's local optimizer
    if inner is not None:
        state = inner.state
    return sum(v.numel() * v.element_size() for s in state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)


def _grad_bytes(model, optimizer) -> int:
    from raytrain_x.torch.zero_optimizer import ShardedOptimizer

    if isinstance(optimizer, ShardedOptimizer):  # its flat buffers
        return sum((b.flat_grads if b.flat_grads is not None else b.shard_out).nbytes
                   for b in optimizer.reducer._buckets)
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        g = p.grad
        if g is not None:
            base = g.untyped_storage()
            if base.data_ptr() not in seen:
                seen.add(base.data_ptr())
                total += base.nbytes()
    return total


def _worker(rank: int, size: int, port: int, way: str, args, queue) -> None:
    import raytrain_x.torch as rx
    from raytrain_x.torch.workloads import GPTDecoder, synthetic_tokens

    cuda = args.device == "cuda"
    join_world(rank, size, port, {"RAYTRAIN_X_GPU_OPERATIONS": "gloo"} if cuda else None)
    rx.init()
    torch.manual_seed(0)
    model = GPTDecoder(layers=args.layers, width=args.width).to(args.device)
    ids, targets = (t.to(args.device) for t in synthetic_tokens(args.batch, seed=rank))
    if way.startswith("ddp") or way == "zero_ddp":
        cap = 25.0 if way == "zero_ddp" else float(way[3:])
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
        if way == "zero_ddp":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW,
                                          lr=1e-4)
        else:
            opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    else:
        net = model
        opt = rx.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4),
                                      named_parameters=model.named_parameters(),
                                      zero_stage=int(way[2]))

    by_hand = way.endswith("_sync")
    phases: dict[str, list[float]] = {"backward": [], "step": []}

    def mark(phase: str, began: float) -> float:
        if cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        phases[phase].append(now - began)
        return now

    def step():
        began = time.perf_counter()
        opt.zero_grad()
        logits = net(ids)
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                          targets.reshape(-1)).backward()
        # where the time goes: backward (reductions start in it), then the step (waiting
        # for the reductions still under way, and the allgather)
        began = mark("backward", began)
        if by_hand:
            opt.synchronize()
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        mark("step", began)

    seconds = median_across_ranks(step, args.steps, warmup=2)
    peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda else
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    out = {"step_s": seconds, "state_bytes": _state_bytes(opt),
           "grad_bytes": _grad_bytes(model, opt), "peak_mb": peak,
           **{f"{k} ms": 1000 * statistics.median(v) for k, v in phases.items() if v}}
    report_slowest(queue, out, rank, size)
    rx.shutdown()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--ddp-buckets", type=float, nargs="+", default=[25.0, 100.0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--ways", nargs="+", default=None,
                        help="run only these ways and print their figures")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every way this many times, interleaved; report medians")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ways = [f"ddp{c:g}" for c in args.ddp_buckets] + ["zero_ddp", "rx0", "rx1", "rx2"]
    if args.ways:  # a subset, to look at one way (the ratios need every way)
        for way in args.ways:
            print(f"{way}: {run_ranks(_worker, 2, way, args)}", flush=True)
        return
    rounds: dict[str, list[dict]] = {way: [] for way in ways}
    for r in range(args.rounds):  # interleaved: a drift of the machine touches every way
        for way in ways:
            rounds[way].append(run_ranks(_worker, 2, way, args))
            print(f"round {r + 1}/{args.rounds} {way}: {rounds[way][-1]}", flush=True)
    results = {way: {k: (statistics.median(o[k] for o in runs)
                         if isinstance(runs[0][k], float) else runs[0][k])
                     for k in runs[0]} for way, runs in rounds.items()}
    if args.rounds > 1:
        print("step ms, round by round:", {w: [round(1000 * o["step_s"]) for o in runs]
                                           for w, runs in rounds.items()})
    peak = "peak CUDA MB" if args.device == "cuda" else "peak RSS MB"
    best_ddp = min((w for w in ways if w.startswith("ddp")), key=lambda w: results[w]["step_s"])
    base = results["rx0"]
    rows = [{"way": w, "step ms": 1000 * r["step_s"], "state MB": r["state_bytes"] / 2**20,
             "grad MB": r["grad_bytes"] / 2**20, peak: r["peak_mb"]}
            for w, r in results.items()]
    print_table(rows, ["way", "step ms", "state MB", "grad MB", peak])
    ratios = {
        "best_ddp": best_ddp,
        "rx1_state_over_rx0": results["rx1"]["state_bytes"] / base["state_bytes"],
        "rx2_grad_over_rx0": results["rx2"]["grad_bytes"] / base["grad_bytes"],
        **{f"{w}_peak_over_rx0": results[w]["peak_mb"] / base["peak_mb"]
           for w in ("rx1", "rx2")},
        **{f"{w}_speed_over_best_ddp": results[best_ddp]["step_s"] / results[w]["step_s"]
           for w in ("rx0", "rx1", "rx2")},
        **{f"{w}_speed_over_zero_ddp": results["zero_ddp"]["step_s"] / results[w]["step_s"]
           for w in ("rx1", "rx2")},
    }
    for k, v in ratios.items():
        print(f"{k}: {v if isinstance(v, str) else round(v, 3)}")
    name = "zero_step_cuda" if args.device == "cuda" else "zero_step"
    payload = {"results": results, "ratios": ratios, "rounds": rounds}
    print(f"wrote {write_json(name, payload, args.json)}")


if __name__ == "__main__":
    main()
