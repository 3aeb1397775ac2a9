"""Stateful workers, as in Horovod's Ray docs: the model lives in each worker between calls.

Run: .venv/bin/python examples/executor_notebook_style.py
"""

from __future__ import annotations

import ray
import torch

from raytrain_x.ray import RayExecutor


class Trainer:
    """Built once per worker by `executor.start(executable_cls=Trainer)`."""

    def __init__(self, lr: float) -> None:
        import raytrain_x.torch as rx

        rx.init()
        torch.manual_seed(0)
        self.rx = rx
        self.model = torch.nn.Linear(4, 1)
        self.opt = rx.DistributedOptimizer(torch.optim.SGD(self.model.parameters(), lr=lr),
                                           named_parameters=self.model.named_parameters())
        rx.broadcast_parameters(self.model.state_dict(), root_rank=0)
        self.steps = 0

    def train_epoch(self, steps: int = 20) -> float:
        g = torch.Generator().manual_seed(self.rx.rank() * 1000 + self.steps)
        true_w = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
        for _ in range(steps):
            x = torch.randn(16, 4, generator=g)
            loss = torch.nn.functional.mse_loss(self.model(x), x @ true_w.T)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.steps += 1
        return self.rx.allreduce(loss.detach(), name=f"loss.{self.steps}").item()


def main() -> None:
    ray.init(ignore_reinit_error=True)
    settings = RayExecutor.create_settings(timeout_s=30)
    executor = RayExecutor(settings, num_workers=2)
    executor.start(executable_cls=Trainer, executable_kwargs={"lr": 0.05})
    for epoch in range(5):
        losses = executor.execute(lambda trainer: trainer.train_epoch())
        print(f"epoch {epoch + 1}: loss {losses[0]:.4f} (same on all ranks: "
              f"{len(set(losses)) == 1})")
    weights = executor.execute_single(lambda trainer: trainer.model.weight.detach().tolist())
    print(f"rank 0 weights {[round(w, 2) for w in weights[0]]} (target [1, -2, 3, 0.5])")
    executor.shutdown()


if __name__ == "__main__":
    main()
