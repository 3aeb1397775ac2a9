"""The local optimizer of a sharded `DistributedOptimizer` (`zero_stage` 1 or 2): an
instance of the user's optimizer class over the parameters a rank owns, how it steps some
of them at a time."""

from __future__ import annotations

import inspect

import torch

from raytrain_x.common.errors import ConfigError

# an optimizer's settings that choose how it computes, not what
IMPLEMENTATIONS = ("fused", "foreach")


def build_local(cls: type, groups: list[dict], defaults: dict) -> torch.optim.Optimizer:
    """`cls` over `groups` (each carrying every setting): the constructor gets those of
    `defaults` it names (AdamW's defaults hold Adam's `decoupled_weight_decay`, which AdamW
    does not take), in torch's fused kernel where that is the same update, faster."""
    accepted = inspect.signature(cls.__init__).parameters
    takes_any = any(a.kind is inspect.Parameter.VAR_KEYWORD for a in accepted.values())
    named = {k: v for k, v in defaults.items() if takes_any or k in accepted}
    try:
        return _fused_on_cpu(cls, groups, named) or cls(groups, **named)
    except TypeError as exc:
        raise ConfigError(f"zero_stage needs an optimizer class that can be built as "
                          f"cls(param_groups, **defaults); {cls.__name__} cannot: "
                          f"{exc}") from None


def steps_each_parameter(cls: type) -> bool:
    """Whether `cls` updates each parameter from its own gradient and state alone, so that
    stepping some parameters, then the others, is one step of all: torch's optimizers,
    except LBFGS (one search over every parameter). A class from elsewhere may compute
    over all of them (a global norm) and is stepped whole."""
    return cls.__module__.startswith("torch.optim.") and cls.__name__ != "LBFGS"


def step_only(local: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """One step of `local` over `params` only (its groups keep their settings)."""
    if not params:
        return
    chosen = set(params)
    every = [group["params"] for group in local.param_groups]
    try:
        for group, ps in zip(local.param_groups, every):
            group["params"] = [p for p in ps if p in chosen]
        local.step()
    finally:
        for group, ps in zip(local.param_groups, every):
            group["params"] = ps


def _fused_on_cpu(cls: type, groups: list[dict], defaults: dict) -> torch.optim.Optimizer | None:
    """The local optimizer in torch's fused kernel where the user chose no implementation
    and every owned parameter is in host memory: there torch's default steps one tensor at
    a time (3.5x slower for AdamW over the GPT workload's tensors), while on CUDA its
    default is already a multi-tensor kernel. Same update, one pass over the memory. None
    where the class has no fused form or refuses these parameters."""
    chosen = any(g.get(k) is not None for g in groups for k in IMPLEMENTATIONS)
    if chosen or "fused" not in defaults or any(g.get("differentiable") for g in groups):
        return None
    params = [p for g in groups for p in g["params"]]
    if not params or any(p.device.type != "cpu" for p in params):
        return None
    try:  # the groups carry every setting, `fused` too
        return cls([{**g, "fused": True} for g in groups], **{**defaults, "fused": True})
    except (RuntimeError, ValueError, TypeError):  # dtypes or settings fused cannot take
        return None
