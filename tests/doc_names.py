"""The names the guides' code blocks leave to the reader, made small and real: a model and
its data, a training function. `tests/integration/test_doc_snippets.py` runs each worker
and driver block after this module's code (driver blocks also get `settings` and
`RayExecutor`), so a block reads as the guide shows it and still runs."""

from __future__ import annotations

EPOCHS = 2


def build():
    """A model and its optimizer, as a training script builds them."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def _batches(n: int = 4):
    import torch

    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=generator), torch.randn(16, 2, generator=generator))
            for _ in range(n)]


my_shard_of_the_data = _batches()


def evaluate(model) -> float:
    import torch

    x, y = _batches(1)[0]
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


def train_and_evaluate(lr: float) -> float:
    """A training loop inside a Tune trial's workers: a few steps, then an accuracy."""
    import torch

    import raytrain_x.torch as rx

    model, _ = build()
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                  named_parameters=model.named_parameters())
    for x, y in my_shard_of_the_data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return 1.0 / (1.0 + evaluate(model))


def train_some_steps(steps: int = 3) -> None:
    """A few allreduces, so the trace has something in it."""
    import torch

    import raytrain_x.torch as rx

    for i in range(steps):
        rx.allreduce(torch.ones(4), name=f"step{i}")


def train_fn() -> int:
    """A training function the guides hand to `executor.run`."""
    import torch

    import raytrain_x.torch as rx

    rx.init()
    model, opt = build()
    opt = rx.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    rx.broadcast_parameters(model.state_dict(), root_rank=0)
    for x, y in my_shard_of_the_data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return rx.rank()


def train_loop(config: dict) -> None:
    """A Ray Train loop (`RaytrainXTrainer`): a few steps at `config["lr"]`, then the loss
    reported to Ray Train."""
    import ray.train
    import torch

    import raytrain_x.torch as rx

    rx.init()
    model, _ = build()
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=config["lr"]),
                                  named_parameters=model.named_parameters())
    rx.broadcast_parameters(model.state_dict(), root_rank=0)
    for x, y in my_shard_of_the_data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    ray.train.report({"loss": evaluate(model)})
