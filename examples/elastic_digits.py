"""Elastic training of the digits MLP: survives workers that die or join.

Run:  raytrain-x run -np 2 --min-np 1 --max-np 3 python examples/elastic_digits.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_digits import load_shard  # noqa: E402

import raytrain_x.torch as rx  # noqa: E402


def main(epochs: int = 8, batch_size: int = 32) -> None:
    rx.init()
    torch.manual_seed(0)
    (x, y), (x_test, y_test) = load_shard(0, 1)  # every rank shards by its current rank
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                  named_parameters=model.named_parameters())
    state = rx.elastic.TorchState(model, opt, epoch=0, batch=0)

    @rx.elastic.run
    def train(state):
        while state.epoch < epochs:
            shard_x, shard_y = x[rx.rank()::rx.size()], y[rx.rank()::rx.size()]
            steps = len(shard_x) // batch_size
            while state.batch < steps:
                i = state.batch * batch_size
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(shard_x[i:i + batch_size]),
                                                         shard_y[i:i + batch_size])
                loss.backward()
                opt.step()
                state.batch += 1
                if state.batch % 10 == 0:
                    state.commit()  # in memory; also where new workers join
            state.epoch += 1
            state.batch = 0
            state.commit()
            if rx.rank() == 0:
                print(f"epoch {state.epoch}/{epochs} on {rx.size()} workers", flush=True)
        with torch.no_grad():
            return (model(x_test).argmax(1) == y_test).float().mean().item()

    accuracy = train(state)
    if rx.rank() == 0:
        print(f"test accuracy {accuracy:.3f}", flush=True)


if __name__ == "__main__":
    main()
