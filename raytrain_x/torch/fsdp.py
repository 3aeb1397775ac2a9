"""A model sharded by torch's FSDP2 (`fully_shard`) moved to a new world in memory.

FSDP2 keeps each parameter as a DTensor cut along dim 0 over its mesh (`torch.chunk`'s
cut), the padded local rows in one flat buffer, and its optimizer's state as DTensors cut
alike. `sharded_layout` describes that layout for `raytrain_x.elastic.reshard`;
`local_chunks` gives this rank's rows of every parameter and state; `rebind` points every
FSDP parameter group at a new mesh and puts this rank's new rows in place (the parameters
are new objects: the optimizer's groups and state follow them). Nothing is gathered whole:
a parameter is re-made on the meta device, then given its local rows.

This reaches into FSDP2's parameter groups (`FSDPParamGroup.mesh_info`,
`FSDPParam._init_sharded_param`, its lazily made all-gather buffers), which torch does not
promise to keep: raytrain-x pins torch, and `tests/integration/test_fsdp_resize.py` holds
this module to that torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from raytrain_x.common.errors import ConfigError
from raytrain_x.elastic.reshard import ShardedTensor

STATE_SEPARATOR = "::"  # "<parameter>::<state>": an optimizer state cut with its parameter


def _groups(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    groups = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                groups.append(group)
    if not groups:
        raise ConfigError("the model has no parameters sharded by fully_shard; wrap it (or "
                          "its blocks, then the model) with torch's fully_shard first")
    return groups


def mesh_info(model: nn.Module) -> Any:
    """The mesh info (`shard_mesh_rank`, `shard_mesh_size`) the model is sharded over."""
    return _groups(model)[0].mesh_info


def is_sharded(model: nn.Module) -> bool:
    """Whether `fully_shard` wrapped `model` or any of its modules."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _fsdp_params(model: nn.Module) -> dict[str, Any]:
    """Every FSDP parameter by its name in `model.named_parameters()`."""
    by_param = {id(fp.sharded_param): fp for group in _groups(model)
                for fp in group.fsdp_params}
    named = {name: by_param[id(p)] for name, p in model.named_parameters()
             if id(p) in by_param}
    for name, fp in named.items():
        if fp.fsdp_placement.dim != 0:
            raise ConfigError(f"{name!r} is sharded on dim {fp.fsdp_placement.dim}; a resize "
                              "re-shards parameters cut on dim 0 (fully_shard's default)")
    return named


def _sharded_states(optimizer: torch.optim.Optimizer | None,
                    param: nn.Parameter) -> dict[str, torch.Tensor]:
    """The optimizer's state of `param` that is cut with it (its DTensors)."""
    from torch.distributed.tensor import DTensor

    if optimizer is None:
        return {}
    return {k: v for k, v in optimizer.state.get(param, {}).items()
            if isinstance(v, DTensor) and v.dim() > 0}


def sharded_layout(model: nn.Module,
                   optimizer: torch.optim.Optimizer | None = None) -> list[ShardedTensor]:
    """Every sharded parameter of `model`, then its optimizer states cut with it
    (`"<parameter>::<state>"`), as rows and bytes a row, in `named_parameters` order."""
    layout = []
    for name, fp in _fsdp_params(model).items():
        size = fp._orig_size
        row = size[1:].numel() if len(size) > 1 else 1
        layout.append(ShardedTensor(name, int(size[0]), row * fp.sharded_param.element_size()))
        for key, value in _sharded_states(optimizer, fp.sharded_param).items():
            layout.append(ShardedTensor(f"{name}{STATE_SEPARATOR}{key}", int(size[0]),
                                        row * value.element_size()))
    return layout


def local_chunks(model: nn.Module,
                 optimizer: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
    """This rank's rows of every entry of `sharded_layout`, in its order (views)."""
    chunks = []
    for fp in _fsdp_params(model).values():
        chunks.append(fp.sharded_param.to_local())
        chunks += [v.to_local() for v in _sharded_states(optimizer, fp.sharded_param).values()]
    return chunks


def replicated_states(model: nn.Module,
                      optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """The optimizer's state of each sharded parameter that is not cut with it (AdamW's
    `step`): the same on every rank, so any one rank's serves a newcomer."""
    from torch.distributed.tensor import DTensor

    return {name: {k: v for k, v in optimizer.state.get(fp.sharded_param, {}).items()
                   if not (isinstance(v, DTensor) and v.dim() > 0)}
            for name, fp in _fsdp_params(model).items()}


def rebind(model: nn.Module, optimizer: torch.optim.Optimizer | None, mesh: Any,
           rows: Mapping[str, torch.Tensor],
           replicated: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Points every FSDP parameter group of `model` at `mesh` and gives each parameter (and
    each optimizer state cut with it) this rank's new rows, `rows` keyed as
    `sharded_layout` names them. The optimizer's state of a parameter is rebuilt from the
    rows named for it and, where given, `replicated` (`replicated_states` of a rank that
    has them: a newcomer's optimizer has none yet); without `replicated` this rank's own
    are kept.

    Raises:
        ConfigError: a parameter's rows are missing or have the wrong shape.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
    from torch.distributed.tensor import DTensor, Shard

    info = FSDPMeshInfo(mesh, shard_mesh_dim=0)
    params = _fsdp_params(model)
    renamed: dict[int, nn.Parameter] = {}
    states: dict[nn.Parameter, dict[str, Any]] = {}
    for group in _groups(model):
        group.mesh_info = info
        if group.post_forward_mesh_info is not None:
            group.post_forward_mesh_info = info
    for name, fp in params.items():
        old = fp.sharded_param
        if name not in rows:
            raise ConfigError(f"no rows given for {name!r}")
        mine = rows[name]
        kept = optimizer.state.get(old, {}) if optimizer is not None else {}
        meta = nn.Parameter(torch.empty(fp._orig_size, dtype=old.dtype, device="meta"),
                            requires_grad=old.requires_grad)
        fp._init_sharded_param(meta, fp.device, None, info)
        padded = torch.zeros(fp.padded_sharded_param_size, dtype=old.dtype, device=fp.device)
        if mine.shape[1:] != padded.shape[1:] or mine.shape[0] > padded.shape[0]:
            raise ConfigError(f"rows of {name!r} have shape {tuple(mine.shape)}; this rank's "
                              f"chunk holds up to {tuple(padded.shape)}")
        padded[:mine.shape[0]] = mine
        fp._sharded_param_data = padded.view(-1)
        fp.sharded_param = nn.Parameter(fp.to_sharded_dtensor(padded[:mine.shape[0]]),
                                        requires_grad=old.requires_grad)
        fp._setattr_on_modules(fp.sharded_param)
        # buffers sized for the old world, made again at the next all-gather
        fp.all_gather_outputs = []
        fp._unsharded_inner_tensors = []
        if hasattr(fp, "_unsharded_param"):
            del fp._unsharded_param
        renamed[id(old)] = fp.sharded_param
        prefix = f"{name}{STATE_SEPARATOR}"
        # the state's own tensors: `rows` may be kept (a commit's copy)
        state = {key[len(prefix):]: DTensor.from_local(
                     value.to(fp.device, copy=True), mesh, [Shard(0)], run_check=False,
                     shape=fp._orig_size, stride=fp._contiguous_orig_stride)
                 for key, value in rows.items() if key.startswith(prefix)}
        given = replicated.get(name, {}) if replicated is not None else {
            k: v for k, v in kept.items() if not (isinstance(v, DTensor) and v.dim() > 0)}
        state.update({k: v.clone() if torch.is_tensor(v) else v for k, v in given.items()})
        if state:
            states[fp.sharded_param] = state
    if optimizer is not None:
        for group in optimizer.param_groups:
            group["params"] = [renamed.get(id(p), p) for p in group["params"]]
        for p in [p for p in optimizer.state if id(p) in renamed]:
            del optimizer.state[p]
        optimizer.state.update(states)
