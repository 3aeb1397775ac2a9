"""Autotuning ZeRO stage and micro-batch (DeepSpeed's fast mode) against DeepSpeed's
hand-tuned rule, under a memory cap that stage 0 cannot meet at its best micro-batch.

A GPT decoder of `raytrain_x.torch.workloads` (2 wide layers, so that the AdamW state is a
good part of a rank's memory), AdamW, 2 workers per experiment (Ray Tune trials through
`autotune_experiments`), a fixed global batch (gradient accumulation makes up the rest):
  1. stage 0 at every micro-batch size (a grid): its throughput and peak memory per size;
     the cap is set just below the peak of stage 0's best size, so that stage 0 cannot
     run it (or --cap-mb);
  2. the rule: stage 0, the micro-batch doubled until the next one goes over the cap;
  3. the autotuner: `autotune_experiments(search="zero", max_memory_per_worker=cap,
     max_experiments=13)`;
  4. the rule's choice and the autotuner's re-measured in interleaved rounds (medians).
Prints each step and the ratio autotuner / rule; writes results/zero_autotune.json.

Run alone (it measures time): .venv/bin/python benchmarks/zero_autotune.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import ray

from common import print_table, write_json


def make_train_fn(args):
    """The experiment: every worker trains `steps` steps of the global batch."""
    layers, width, vocab, seq = args.layers, args.width, args.vocab, args.seq

    def train_fn(config: dict) -> None:
        import time

        import torch

        import raytrain_x.torch as rx
        from raytrain_x.torch.workloads import GPTDecoder, synthetic_tokens
        from raytrain_x.tune_integration import report

        rx.init()
        torch.set_num_threads(1)
        torch.manual_seed(0)
        mbs = config["micro_batch_size"]
        passes = config.get("gradient_accumulation_steps", 1)
        model = GPTDecoder(vocab=vocab, layers=layers, width=width)
        opt = rx.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4),
                                      named_parameters=model.named_parameters(),
                                      zero_stage=config["zero_stage"],
                                      backward_passes_per_step=passes)
        ids, targets = synthetic_tokens(mbs, seq=seq, vocab=vocab, seed=rx.rank())
        while True:  # Tune stops the experiment after its steps
            began = time.perf_counter()
            opt.zero_grad()
            for _ in range(passes):
                logits = model(ids)
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)) / passes
                loss.backward()
            opt.step()
            report({"samples_per_sec": mbs * passes * rx.size() / (time.perf_counter() - began)})
    return train_fn


def _experiments(args, space, search, out: Path, **kwargs):
    from raytrain_x.tune_integration import autotune_experiments

    return autotune_experiments(
        make_train_fn(args), space, num_workers=2, metric="samples_per_sec", search=search,
        steps_per_experiment=args.steps, start_step=1, output_dir=out,
        global_batch_size=args.global_batch, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cap-mb", type=float, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent)}})
    tmp = Path(tempfile.mkdtemp(prefix="zero_autotune_"))
    try:
        grid = _experiments(args, {"zero_stage": [0], "micro_batch_size": args.micro_batches},
                            "grid", tmp / "stage0", max_experiments=len(args.micro_batches))
        stage0 = {e.config["micro_batch_size"]: e for e in grid.experiments}
        peaks = {m: _peak(tmp / "stage0", e.index) for m, e in stage0.items()}
        rows = [{"micro-batch": m, "samples/s": e.metric, "peak MB": peaks[m]}
                for m, e in sorted(stage0.items())]
        print_table(rows, ["micro-batch", "samples/s", "peak MB"])
        best0 = max((e for e in stage0.values() if e.metric), key=lambda e: e.metric)
        # below stage 0's best by more than the peaks' run-to-run spread
        cap = args.cap_mb or 0.97 * peaks[best0.config["micro_batch_size"]]
        rule = None
        for m in sorted(stage0):  # doubled until the next one goes over the cap
            if stage0[m].metric is None or peaks[m] > cap:
                break
            rule = m
        print(f"stage 0's best: micro-batch {best0.config['micro_batch_size']}; cap {cap:.0f} MB;"
              f" the rule's choice: micro-batch {rule}", flush=True)
        tuned = _experiments(args, {"zero_stage": [0, 1, 2],
                                    "micro_batch_size": args.micro_batches},
                             "zero", tmp / "tuned", max_memory_per_worker=cap,
                             max_experiments=13)
        print(f"autotuner: {len(tuned.experiments)} experiments, best {tuned.best_config}",
              flush=True)
        if rule is None or tuned.best_config is None:
            raise SystemExit("nothing fits under the cap: raise --cap-mb")
        contenders = {"rule": {"zero_stage": [0], "micro_batch_size": [rule]},
                      "autotuned": {k: [v] for k, v in tuned.best_config.items()}}
        again: dict[str, list[float]] = {name: [] for name in contenders}
        for r in range(args.rounds):
            for name, space in contenders.items():
                result = _experiments(args, space, "grid", tmp / f"again_{name}_{r}",
                                      max_experiments=1)
                again[name].append(result.experiments[0].metric or 0.0)
        medians = {k: statistics.median(v) for k, v in again.items()}
        ratio = medians["autotuned"] / medians["rule"]
        print(f"re-measured samples/s: {again}; autotuned / rule: {ratio:.2f}x")
        payload = {"stage0": rows, "cap_mb": cap, "rule_micro_batch": rule,
                   "autotuned": [{"config": e.config, "samples_per_sec": e.metric,
                                  "error": e.error[:200]} for e in tuned.experiments],
                   "best_config": tuned.best_config, "again": again, "medians": medians,
                   "autotuned_over_rule": ratio, "experiments": len(tuned.experiments)}
        print(f"wrote {write_json('zero_autotune', payload, args.json)}")
    finally:
        ray.shutdown()


def _peak(out: Path, index: int) -> float:
    """The largest `peak_memory_mb` an experiment reported (rank 0's)."""
    import csv

    with (out / f"experiment_{index:03d}" / "metrics.csv").open() as f:
        return max(float(row["peak_memory_mb"]) for row in csv.DictReader(f))


if __name__ == "__main__":
    main()
