"""Runs the benchmarks behind the README's headline figures and docs/performance.md's
claims, one after the other and alone (each measures its baseline in the same run and
prints its own ratio), then a summary: each claim, its command, how long it took and
whether it ran to the end.

Run: .venv/bin/python benchmarks/claims.py            (make bench; about 90 minutes)
     .venv/bin/python benchmarks/claims.py --list
     .venv/bin/python benchmarks/claims.py --only pack zero
Emulated hosts need root (network namespaces); as another user those claims are skipped.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (the claim, its command, whether it needs root)
CLAIMS: dict[str, tuple[str, list[str], bool]] = {
    "pack": ("native pack + unpack vs torch.cat and copy-back",
             ["benchmarks/pack_bench.py"], False),
    "recovery": ("a worker killed / a node drained or killed: elastic vs restart",
                 ["benchmarks/elastic_recovery.py"], False),
    "storage": ("every worker lost: durable checkpoint vs TorchTrainer's restart",
                ["benchmarks/elastic_recovery.py", "--storage"], False),
    "commit": ("a commit's cost and the step with a commit every step",
               ["benchmarks/elastic_commit.py"], False),
    "checkpoint": ("throughput with durable checkpoints every 30 s vs none",
                   ["benchmarks/durable_checkpoint.py", "--every", "30", "--seconds", "95"],
                   False),
    "checksum": ("a checkpoint write hashed as written vs re-read vs no checksums",
                 ["benchmarks/checkpoint_checksum.py", "--rounds", "15"], False),
    "restore-bytes": ("bytes each rank reads restoring a ZeRO-1 checkpoint from S3",
                      ["benchmarks/restore_bytes.py"], False),
    "networks": ("ResNet-18 / GPT samples/s vs DDP, 2 emulated hosts",
                 ["benchmarks/real_networks.py", "--hosts", "2", "--steps", "4"], True),
    "autotune": ("autotune vs the default knobs, ResNet-18, one host",
                 ["benchmarks/real_networks.py", "--autotune", "resnet18"], False),
    "trainer": ("RaytrainXTrainer vs Ray Train's TorchTrainer",
                ["benchmarks/ray_train_vs_torch_trainer.py"], False),
    "trainer-idle-cpu": ("the CPU of the elastic trainer's machinery vs the fixed trainer's",
                         ["benchmarks/elastic_trainer_idle_cpu.py", "--repeats", "2"], False),
    "zero": ("ZeRO stage 1 and 2 vs torch's ZeroRedundancyOptimizer with DDP",
             ["benchmarks/zero_step.py", "--rounds", "5"], False),
    "regime": ("the engine's fixed costs at a GPU's step rate vs DDP's best bucket",
               ["benchmarks/gpu_regime.py", "--step-ms", "30", "--repeats", "3",
                "--steps", "8"], False),
    "sweep": ("allreduce bandwidth vs raw torch.distributed, 4 KB to 64 MB",
              ["benchmarks/allreduce_sweep.py"], False),
    "startup": ("start-up: RayExecutor.start and the first step",
                ["benchmarks/startup.py"], False),
    "tensorflow": ("a TensorFlow step vs MultiWorkerMirroredStrategy",
                   ["benchmarks/tf_step.py"], False),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=sorted(CLAIMS), metavar="NAME",
                        help="run these claims only (--list names them)")
    parser.add_argument("--list", action="store_true", help="name every claim and stop")
    args = parser.parse_args()
    if args.list:
        for name, (claim, command, root) in CLAIMS.items():
            print(f"{name:11} {claim}{' (root)' if root else ''}\n{'':11} "
                  f"python {' '.join(command)}")
        return 0
    chosen = args.only or list(CLAIMS)
    summary = []
    for i, name in enumerate(chosen, 1):
        claim, command, root = CLAIMS[name]
        shown = f"python {' '.join(command)}"
        if root and os.geteuid() != 0:
            summary.append((name, shown, "skipped (needs root)", 0.0))
            continue
        print(f"\n=== [{i}/{len(chosen)}] {name}: {claim}\n=== {shown}", flush=True)
        began = time.monotonic()
        code = subprocess.call([sys.executable, *command], cwd=ROOT)
        summary.append((name, shown, "ok" if code == 0 else f"failed ({code})",
                        time.monotonic() - began))
    print("\nclaim        result            minutes  command")
    for name, shown, result, seconds in summary:
        print(f"{name:12} {result:17} {seconds / 60:7.1f}  {shown}")
    print("each script printed its ratios above and wrote its JSON into results/")
    return 0 if all(r in ("ok", "skipped (needs root)") for _, _, r, _ in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
