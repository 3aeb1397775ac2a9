"""`DistributedOptimizer`: Horovod's wrapper of a torch optimizer, on the gradient-sync
core (`grad_sync`) with the reducer its arguments choose: allreduce while backward runs
(the default, `allreduce_reducer`), Adasum (`adasum_reducer`), ZeRO's sharded state
(`zero_optimizer`), or any `Reducer` given as `reducer=` (LocalSGD and DiLoCo in
`local_steps`, PowerSGD in `powersgd`, or a user's own).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from raytrain_x.common.errors import ConfigError
from raytrain_x.common.training import training_settings
from raytrain_x.core.collectives import Adasum, Average, Sum
from raytrain_x.core.process_sets import ProcessSet, global_process_set
from raytrain_x.engine.adasum import check_size
from raytrain_x.torch.adasum_reducer import AdasumReducer
from raytrain_x.torch.allreduce_reducer import AllreduceReducer
from raytrain_x.torch.compression import Compression, Compressor
from raytrain_x.torch.grad_sync import Reducer, wrap
from raytrain_x.torch.zero_optimizer import ShardedOptimizer, ZeroReducer


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: str = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: int | Sequence[Sequence[torch.Tensor]] | None = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
    bucket_cap_mb: float | None = None,
    zero_stage: int | None = None,
    reducer: Reducer | None = None,
) -> Any:
    """Wraps `optimizer` so gradients are allreduced while backward runs.

    The result is an instance of a subclass of the optimizer's class (isinstance checks and
    LR schedulers keep working). Each parameter's gradient is submitted from a
    post-accumulate-grad hook as soon as it is ready; `step()` waits for all of them.

    Args:
        optimizer: the local optimizer.
        named_parameters: `model.named_parameters()`, used to name the collectives.
        compression: `Compression.fp16` halves the bytes on the wire.
        backward_passes_per_step: backward passes accumulated locally per allreduce.
        op: `Average` (default), `Sum`, or `Adasum` (Horovod's delta optimizer: each rank
            steps locally and the steps' deltas are combined by Adasum).
        gradient_predivide_factor: divide by this before the sum and by size/factor after.
        num_groups: deprecated Horovod spelling of `groups=<int>`.
        groups: an int k splits the gradients into k fixed buckets of about equal count;
            lists of parameters make one bucket each (parameters in no list are reduced on
            their own). Either way the buckets stay fixed (out of autotune's search).
        sparse_as_dense: reduce sparse gradients (`nn.Embedding(sparse=True)`) as dense
            tensors (given back sparse); by default they go as Horovod sends them, an
            allgather of indices and values.
        process_set: ranks the gradients are reduced over.
        bucket_cap_mb: by default (None, or 0) the gradients are views of one flat buffer
            per dtype and device, cut as DDP cuts its buckets into runs of neighbouring
            gradients (the first closes at 1 MB, the others at a sixteenth of the buffer, at
            most the fusion threshold knob, `--fusion-threshold-mb`, which autotune moves);
            each run goes to the engine the moment its last gradient is ready and is
            reduced as it is, where it lies. A size in MB makes DDP-style fixed buckets
            instead, each with a buffer of its own and reduced as one collective when its
            last gradient is ready; the fusion threshold then leaves autotune's search.
        zero_stage: 0 keeps every optimizer state and gradient on every rank (the
            default, unless a config file's `zero_stage` reached this worker through
            `raytrain-x run --config-file` or `RaytrainXConfig(config_file=...)`).
            1 shards the optimizer state (ZeRO stage 1): each rank owns whole parameters,
            gradients are reduce-scattered bucket by bucket as backward produces them, each
            rank steps its own parameters and the updated ones are allgathered; 2 also
            keeps only this rank's reduced gradients. `bucket_cap_mb` sizes the buckets
            (25 MB by default); `state_dict()` gives the full state and every rank calls it;
            `clip_grad_norm_` clips by the total norm. Not with `op=Adasum`, `compression`
            or `groups`, nor sparse gradients.
        reducer: how the gradients are combined, in place of `op`'s allreduce: for slow
            links `LocalSGD(sync_every=H)` or `DiLoCo(sync_every=H)` (no gradient is
            reduced; each rank steps on its own and every H steps the models are averaged,
            or an outer optimizer steps on the averaged pseudo-gradients) or
            `PowerSGD(matrix_rank=r)` (gradients compressed to rank r with error
            feedback); or a `rx.Reducer` of your own (docs/reducers.md). One instance per
            optimizer. Not with `op=Adasum`, `compression`, `groups`, `bucket_cap_mb` or
            `zero_stage`: the reducer has its own.
    """
    if backward_passes_per_step < 1:
        raise ConfigError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    if op not in (Average, Sum, Adasum):
        raise ConfigError(f"DistributedOptimizer op must be rx.Average, rx.Sum or rx.Adasum, "
                          f"got {op!r}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ConfigError("gradient_predivide_factor needs op=rx.Average")
    if num_groups and groups is not None:
        raise ConfigError("give groups= (num_groups is its deprecated spelling), not both")
    groups = groups if groups is not None else (num_groups or None)
    if zero_stage is None:  # a config file's, through raytrain-x run or the trainer
        zero_stage = training_settings().get("zero_stage", 0)
    if zero_stage == 3:  # one implementation of sharded parameters: torch's FSDP2
        raise ConfigError(
            "zero_stage=3 shards the parameters too: shard the model with torch's "
            "fully_shard over rx.device_mesh() (each block, then the model) and give it a "
            "plain torch optimizer; rx.elastic.TorchState(model, optimizer) keeps it "
            "elastic (docs/fsdp.md)")
    if zero_stage not in (0, 1, 2):
        raise ConfigError(f"zero_stage must be 0, 1 or 2, got {zero_stage!r}")
    if reducer is not None:
        if not isinstance(reducer, Reducer):
            raise ConfigError(f"reducer must be an rx.Reducer such as rx.LocalSGD(...), "
                              f"rx.DiLoCo(...) or rx.PowerSGD(...), got {reducer!r}")
        given = {"op=rx.Adasum": op == Adasum, "compression": compression is not
                 Compression.none, "groups": bool(groups), "bucket_cap_mb": bucket_cap_mb
                 is not None, "zero_stage": bool(zero_stage)}
        clash = [name for name, set_ in given.items() if set_]
        if clash:
            raise ConfigError(f"{reducer!r} combines the gradients its own way; leave out "
                              f"{', '.join(clash)}")
        return wrap(optimizer, named_parameters, reducer, backward_passes_per_step,
                    process_set)
    if zero_stage:
        if op == Adasum:
            raise ConfigError("zero_stage needs op=rx.Average or rx.Sum, not rx.Adasum")
        if compression is not Compression.none:
            raise ConfigError("zero_stage does not compress gradients; leave compression out")
        if groups:
            raise ConfigError("zero_stage lays the gradients out itself; leave groups out "
                              "(bucket_cap_mb sizes its buckets)")
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ConfigError(f"bucket_cap_mb must be > 0 with zero_stage, got "
                              f"{bucket_cap_mb}")
        zero = ZeroReducer(zero_stage, op, gradient_predivide_factor, bucket_cap_mb)
        return wrap(optimizer, named_parameters, zero, backward_passes_per_step, process_set,
                    ShardedOptimizer)
    if op == Adasum:
        check_size(process_set.size())
        return wrap(optimizer, named_parameters, AdasumReducer(compression),
                    backward_passes_per_step, process_set)
    if bucket_cap_mb is not None and not bucket_cap_mb >= 0:
        raise ConfigError(f"bucket_cap_mb must be >= 0 (or None to follow the fusion "
                          f"threshold knob), got {bucket_cap_mb}")
    allreduce = AllreduceReducer(op, gradient_predivide_factor, compression, bucket_cap_mb,
                                 groups, sparse_as_dense)
    return wrap(optimizer, named_parameters, allreduce, backward_passes_per_step, process_set)
