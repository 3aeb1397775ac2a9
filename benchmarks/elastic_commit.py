"""What an elastic commit costs on the GPT workload, --workers processes (2), one way per
fresh set of processes (so each peak memory is its own), for each ZeRO stage (0: unsharded):

  none       training steps with no commit at all (the baseline)
  deepcopy   a commit every step as a deep copy of the state dicts on their own device (the
             commit before host snapshots, kept here as the baseline)
  host       a commit every step as `TorchState` takes it: a host snapshot into reused
             buffers (pinned, on a side stream, overlapping the next forward and backward)

Reported per way: the step time with a commit every step (--steps steps back to back, one
device synchronisation at the end, the median of --repeats such runs, the slower rank);
a commit's own time (device synchronised before and after, so a CUDA copy counts whole);
the peak memory (the CUDA allocator's peak with --device cuda, both ranks sharing GPU 0 over
gloo; resident memory on a CPU). Ratios: commit time host / deepcopy, step time with host
commits / none. Writes results/elastic_commit_<device>_<workers>.json.

Run: .venv/bin/python benchmarks/elastic_commit.py [--device cuda --layers 8 --width 1024]
"""

from __future__ import annotations

import argparse
import copy
import resource
import statistics
import time

import torch
import torch.distributed as dist

from common import (
    join_world,
    lm_step,
    median_across_ranks,
    print_table,
    report_slowest,
    run_ranks,
    write_json,
)

WAYS = ("none", "deepcopy", "host")


class _DeepCopied:
    """A commit as a deep copy on the tensors' own device (the old `TorchState` commit)."""

    def __init__(self, tree):
        self._tree = copy.deepcopy(tree)

    def order_before_modification(self) -> None:
        pass

    def wait(self) -> None:
        pass

    def tree(self):
        return self._tree

    def copy(self):
        return copy.deepcopy(self._tree)


def _worker(rank: int, size: int, port: int, stage: int, way: str, args, queue) -> None:
    import raytrain_x.torch as rx
    from raytrain_x.torch.workloads import GPTDecoder, synthetic_tokens

    cuda = args.device == "cuda"
    join_world(rank, size, port, {"RAYTRAIN_X_GPU_OPERATIONS": "gloo"}
               if cuda and size > 1 else None)  # one rank: NCCL
    rx.init()
    model = GPTDecoder(layers=args.layers, width=args.width).to(args.device)
    ids, targets = (t.to(args.device) for t in synthetic_tokens(args.batch, seed=rank))
    opt = rx.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4),
                                  named_parameters=model.named_parameters(),
                                  zero_stage=stage)

    class DeepCopyState(rx.elastic.TorchState):
        def _snapshot(self):
            return _DeepCopied(self._tree())

    state_type = DeepCopyState if way == "deepcopy" else rx.elastic.TorchState
    state = state_type(model, opt, step=0) if way != "none" else None

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def train_step() -> None:
        lm_step(model, opt, ids, targets)
        if state is not None:
            state.step += 1
            state.commit()

    def steps() -> None:
        for _ in range(args.steps):
            train_step()
        sync()

    commit_ms: list[float] = []

    def timed_commit() -> None:
        sync()
        began = time.perf_counter()
        state.commit()
        sync()
        commit_ms.append(1000 * (time.perf_counter() - began))

    for _ in range(2):  # warm: the optimizer's state exists, the snapshot's buffers too
        train_step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    step_s = median_across_ranks(steps, args.repeats, warmup=1) / args.steps
    if state is not None:
        for _ in range(args.repeats):
            dist.barrier()
            timed_commit()
    peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda else
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    out = {"step_s": step_s, "peak_mb": peak,
           "commit_ms": statistics.median(commit_ms) if commit_ms else 0.0}
    report_slowest(queue, out, rank, size)
    rx.shutdown()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5, help="steps in one timed run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workers", type=int, default=2,
                        help="ranks (on CUDA: 2 share the GPU over gloo, 1 runs NCCL)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results: dict[str, dict] = {}
    rows = []
    peak = "peak CUDA MB" if args.device == "cuda" else "peak RSS MB"
    for stage in args.stages:
        for way in WAYS:
            r = run_ranks(_worker, args.workers, stage, way, args)
            results[f"stage{stage}_{way}"] = r
            print(f"stage {stage} {way}: {r}", flush=True)
            rows.append({"stage": stage, "way": way, "step ms": 1000 * r["step_s"],
                         "commit ms": r["commit_ms"] if way != "none" else "",
                         peak: r["peak_mb"]})
    print_table(rows, ["stage", "way", "step ms", "commit ms", peak])
    ratios = {}
    for stage in args.stages:
        of = {w: results[f"stage{stage}_{w}"] for w in WAYS}
        ratios[f"stage{stage}_commit_host_over_deepcopy"] = (of["host"]["commit_ms"]
                                                             / of["deepcopy"]["commit_ms"])
        ratios[f"stage{stage}_step_host_over_none"] = of["host"]["step_s"] / of["none"]["step_s"]
        ratios[f"stage{stage}_step_deepcopy_over_none"] = (of["deepcopy"]["step_s"]
                                                           / of["none"]["step_s"])
        ratios[f"stage{stage}_peak_host_minus_none_mb"] = (of["host"]["peak_mb"]
                                                           - of["none"]["peak_mb"])
        ratios[f"stage{stage}_peak_deepcopy_minus_none_mb"] = (of["deepcopy"]["peak_mb"]
                                                               - of["none"]["peak_mb"])
    for k, v in ratios.items():
        print(f"{k}: {round(v, 3)}")
    name = f"elastic_commit_{args.device}_{args.workers}"
    print(f"wrote {write_json(name, {'results': results, 'ratios': ratios}, args.json)}")


if __name__ == "__main__":
    main()
