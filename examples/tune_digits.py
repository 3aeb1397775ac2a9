"""Ray Tune over learning rate and micro-batch size; every trial is a 2-worker job.

Run: .venv/bin/python examples/tune_digits.py [--samples 6]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
from ray import tune

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_digits import load_shard  # noqa: E402

from raytrain_x.tune_integration import (  # noqa: E402
    DistributedTrainableCreator,
    get_checkpoint,
    report,
)


def train_digits(config: dict) -> None:
    """Runs on each worker of a trial; rank 0's reports reach Tune."""
    import raytrain_x.torch as rx

    torch.manual_seed(0)
    (x, y), (x_test, y_test) = load_shard(rx.rank(), rx.size())
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=config["lr"]),
                                  named_parameters=model.named_parameters())
    start_epoch = 0
    resume = get_checkpoint()
    if resume:
        saved = torch.load(os.path.join(resume, "model.pt"))
        model.load_state_dict(saved["model"])
        start_epoch = saved["epoch"]
    rx.broadcast_parameters(model.state_dict(), root_rank=0)
    batch = int(config["micro_batch_size"])
    for epoch in range(start_epoch, config.get("epochs", 5)):
        for i in range(0, len(x) - batch + 1, batch):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[i:i + batch]), y[i:i + batch]).backward()
            opt.step()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        with tempfile.TemporaryDirectory() as tmp:
            torch.save({"model": model.state_dict(), "epoch": epoch + 1},
                       os.path.join(tmp, "model.pt"))
            report({"accuracy": accuracy, "epoch": epoch + 1}, checkpoint=tmp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=6)
    args = parser.parse_args()
    import ray
    from ray.tune.search.bayesopt import BayesOptSearch

    ray.init(ignore_reinit_error=True,
             runtime_env={"env_vars": {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}})
    trainable = DistributedTrainableCreator(train_digits, num_workers=2)
    tuner = tune.Tuner(
        trainable,
        param_space={"lr": tune.uniform(0.005, 0.3), "micro_batch_size": tune.uniform(8, 64),
                     "epochs": 4},
        tune_config=tune.TuneConfig(
            search_alg=BayesOptSearch(metric="accuracy", mode="max", random_search_steps=3),
            num_samples=args.samples, max_concurrent_trials=1),
        run_config=tune.RunConfig(name="tune_digits", verbose=1,
                                  storage_path=os.path.abspath("results/tune")))
    results = tuner.fit()
    if not any("accuracy" in (r.metrics or {}) for r in results):  # stopped early (Ctrl-C)
        print("no trial reported an accuracy yet")
        return
    best = results.get_best_result(metric="accuracy", mode="max")
    print(f"best accuracy {best.metrics['accuracy']:.3f} with lr {best.config['lr']:.3f}, "
          f"micro-batch {int(best.config['micro_batch_size'])}")


if __name__ == "__main__":
    main()
