"""A step function for `raytrain-x tune-experiments` (synthetic throughput workload).

Run: raytrain-x tune-experiments --fn examples.experiment_step:step_fn \\
        --space '{"micro_batch_size": [8, 32, 128]}' --search grid --steps-per-experiment 6
"""

from __future__ import annotations

import time

import torch

from raytrain_x.tune_integration import report


def step_fn(config: dict) -> None:
    """Trains a small MLP on synthetic data; reports samples/s per step."""
    import raytrain_x.torch as rx

    batch = int(config["micro_batch_size"])
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10))
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters())
    x, y = torch.randn(batch, 256), torch.randint(0, 10, (batch,))
    for _ in range(100):
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        report({"samples_per_sec": batch * rx.size() / (time.perf_counter() - start)})
