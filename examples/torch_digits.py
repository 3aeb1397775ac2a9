"""Trains an MLP on scikit-learn's bundled digits with DistributedOptimizer.

Run on 2 workers:   raytrain-x run -np 2 python examples/torch_digits.py
As a Ray job:
    ray job submit --working-dir . -- raytrain-x run -np 2 python examples/torch_digits.py
"""

from __future__ import annotations

import argparse

import torch
from sklearn.datasets import load_digits

import raytrain_x.torch as rx


def load_shard(rank: int, size: int):
    """This rank's shard of the training split and the whole test split."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(x), generator=g)
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split][rank::size], y[:split][rank::size]), (x[split:], y[split:])


def train(epochs: int = 15, batch_size: int = 32, lr: float = 0.05) -> float:
    """Trains and returns the test accuracy (the same on every rank)."""
    rx.init()
    torch.manual_seed(0)
    (x, y), (x_test, y_test) = load_shard(rx.rank(), rx.size())
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr * rx.size(),
                                                  momentum=0.9),
                                  named_parameters=model.named_parameters())
    rx.broadcast_parameters(model.state_dict(), root_rank=0)
    rx.broadcast_optimizer_state(opt, root_rank=0)
    steps = len(x) // batch_size
    for epoch in range(epochs):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        total = 0.0
        for step in range(steps):
            idx = perm[step * batch_size:(step + 1) * batch_size]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total += loss.item()
        mean_loss = rx.allreduce(torch.tensor(total / steps), name=f"loss.{epoch}").item()
        if rx.rank() == 0 and (epoch % 5 == 4 or epoch == epochs - 1):
            print(f"epoch {epoch + 1}/{epochs}: loss {mean_loss:.4f}", flush=True)
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    if rx.rank() == 0:
        print(f"test accuracy {accuracy:.3f} on {rx.size()} workers", flush=True)
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="MLP on sklearn digits with raytrain-x")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    a = parser.parse_args()
    train(a.epochs, a.batch_size, a.lr)
    rx.shutdown()
