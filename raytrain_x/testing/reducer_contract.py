"""The contract every gradient reducer keeps, as checks a new one runs: in each rank of a
world (after `rx.init()`, two ranks or more), `check_reducer(make)` trains small models
through `DistributedOptimizer(reducer=make())` and raises `AssertionError` naming the
first broken promise.

What a reducer promises:
- replicas agree: after each step every rank holds the same parameters (a reducer whose
  `local_params` is set promises it after `synchronize()` following an exchange instead);
- it trains: the parameters move, and the loss on the ranks' data goes down;
- a parameter without a gradient in a step (an unused layer) neither hangs nor fails it;
- gradient accumulation (`backward_passes_per_step=2`) and `synchronize()` by hand before
  `step()` under `skip_synchronize()` work;
- its state survives `state_dict()` / `load_state_dict()` into a fresh optimizer;
- it carries on in a new world (after `rx.shutdown()` and `rx.init()`, as after an
  elastic change).

Built-in ways are checked the same way with `DistributedOptimizer` keywords in place of a
reducer (`check_reducer(None, op=rx.Adasum)`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

REDUCER_CONTRACT = ("replicas agree", "it trains", "unused parameters",
                    "accumulation and synchronize by hand", "state round trip", "new world")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 6, generator=g)
    return x, torch.stack([x[:, :3].sum(1), x[:, 3:].sum(1)], 1)


def _optimizer(model: torch.nn.Module, make: Callable[[], Any] | None,
               options: dict[str, Any], **more: Any) -> Any:
    import raytrain_x.torch as rx

    reducer = make() if make is not None else None
    return rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(),
                                   reducer=reducer, **options, **more)


def _same_everywhere(model: torch.nn.Module, what: str) -> None:
    import raytrain_x.torch as rx

    mine = [p.detach().clone() for p in model.parameters()]
    every = rx.allgather_object(mine, name=f"contract.{what}")
    for other in every[1:]:
        for a, b in zip(every[0], other):
            assert torch.allclose(a, b, atol=1e-6), f"replicas agree: ranks differ {what}"


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    import raytrain_x.torch as rx

    x, y = _batch(rx.rank(), step)
    return torch.nn.functional.mse_loss(model(x), y)


def check_reducer(make: Callable[[], Any] | None, steps: int = 8, **options: Any) -> list[str]:
    """Checks `make`'s reducer (or the built-in way `options` choose) against the
    contract; returns the names of the promises kept (`REDUCER_CONTRACT`)."""
    import raytrain_x.torch as rx

    model = _model()
    opt = _optimizer(model, make, options)
    local = opt.reducer.local_params
    start = [p.detach().clone() for p in model.parameters()]
    first = _loss(model, 0).item()
    for step in range(steps):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
        if not local:
            _same_everywhere(model, f"after step {step}")
    if local:  # an exchange an overlap left on the wire lands
        opt.synchronize()
        _same_everywhere(model, "after the last exchange")
    assert any(not torch.equal(a, p) for a, p in zip(start, model.parameters())), \
        "it trains: no parameter moved"
    losses = rx.allgather_object((first, _loss(model, 0).item()), name="contract.loss")
    assert sum(b for _, b in losses) < sum(a for a, _ in losses), "it trains: loss rose"

    unused = torch.nn.ModuleDict({"used": _model(), "unused": torch.nn.Linear(6, 2)})
    opt2 = _optimizer(unused, make, options)
    for step in range(3):
        opt2.zero_grad()
        _loss(unused["used"], step).backward()
        opt2.step()

    accumulating = _model()
    opt3 = _optimizer(accumulating, make, options, backward_passes_per_step=2)
    for step in range(4):
        opt3.zero_grad()
        for half in range(2):
            (_loss(accumulating, 2 * step + half) / 2).backward()
        opt3.synchronize()
        with opt3.skip_synchronize():
            opt3.step()

    fresh_model = _model()
    fresh = _optimizer(fresh_model, make, options)
    fresh.load_state_dict(opt.state_dict())
    _equal_states(opt.state_dict(), fresh.state_dict())

    rx.shutdown()
    rx.init()
    for step in range(steps, steps + 3):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
    if local:
        opt.synchronize()
    else:
        _same_everywhere(model, "in a new world")
    return list(REDUCER_CONTRACT)


def _equal_states(a: Any, b: Any, where: str = "state") -> None:
    """`a` and `b` hold the same values (tensors compared by value)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), \
            f"state round trip: {where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), \
            f"state round trip: {where} has keys {sorted(map(str, a))} then {sorted(map(str, b))}"
        for k in a:
            _equal_states(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"state round trip: {where} changed length"
        for i, (x, y) in enumerate(zip(a, b)):
            _equal_states(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"state round trip: {where} was {a!r}, then {b!r}"
