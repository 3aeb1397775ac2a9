"""A model sharded by torch's FSDP2 (`fully_shard` per layer, AdamW) re-sharded in memory when
its world changes (`raytrain_x.torch.fsdp`, `raytrain_x.torch.reshard`): a newcomer joins 2
ranks, or one of 3 is lost with its chunks' copy on a survivor. Every rank's rows move as
the plan says (nothing gathered whole), FSDP2 goes on over the new mesh, and the parameters
after two more steps match a model trained unsharded on the same global batch."""

from __future__ import annotations

import pytest

from tests.workers import run_workers

STEPS_BEFORE, STEPS_AFTER, BATCH = 2, 2, 12


def _resize(path: str, scenario: str, mixed: bool = False) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import raytrain_x.torch as rx
    from raytrain_x.elastic.reshard import plan_resize
    from raytrain_x.torch.fsdp import local_chunks, replicated_states, sharded_layout

    survivors = rx.ProcessSet([0, 1])
    rx.init(process_sets=[survivors])
    rank = rx.rank()
    dist.init_process_group("gloo", store=dist.FileStore(path, 3), rank=rank, world_size=3)
    old_ranks, members = ([0, 1], [0, 1, 2]) if scenario == "grow" else ([0, 1, 2], [0, 1])

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 7), nn.ReLU(),
                             nn.Linear(7, 5))

    # a mixed precision policy: each block computes in float64, its gradients reduced so
    policy = MixedPrecisionPolicy(param_dtype=torch.float64, reduce_dtype=torch.float64) \
        if mixed else MixedPrecisionPolicy()

    def shard(model, mesh):
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
        return fully_shard(model, mesh=mesh, mp_policy=policy)

    def train(model, opt, step, part, parts):
        generator = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(BATCH, 8, generator=generator), torch.randn(BATCH, 5,
                                                                       generator=generator)
        rows = slice(part * BATCH // parts, (part + 1) * BATCH // parts)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()

    reference = build()
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    model, opt = build(), None
    old_mesh = DeviceMesh("cpu", torch.tensor(old_ranks))
    if rank in old_ranks:
        shard(model, old_mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(STEPS_BEFORE):
        train(reference, reference_opt, step, 0, 1)
        if rank in old_ranks:
            train(model, opt, step, old_ranks.index(rank), len(old_ranks))
    before = _gathered(model, opt) if rank in old_ranks else None  # the state, whole
    # what a commit leaves: each rank its chunks; the lost rank's copy on rank 0
    layout = rx.broadcast_object(sharded_layout(model, opt) if rank == 0 else None, 0)
    like = rx.broadcast_object([torch.empty((0, *c.shape[1:]), dtype=c.dtype)
                                for c in local_chunks(model, opt)] if rank == 0 else None, 0)
    replicated = rx.broadcast_object(replicated_states(model, opt) if rank == 0 else None, 0)
    held = {old_ranks.index(rank): [c.clone() for c in local_chunks(model, opt)]} \
        if rank in old_ranks else {}
    holders = {j: [r] for j, r in enumerate(old_ranks)}
    if scenario == "lose":  # rank 2 goes; its copy lives on rank 0
        copy = rx.broadcast_object(held.get(2) if rank == 2 else None, 2)
        if rank == 0:
            held[2] = copy
        holders[2] = [0]
    positions, plan = plan_resize(layout, len(old_ranks), holders, members)
    order = [m for m, _ in sorted(positions.items(), key=lambda kv: kv[1])]
    new_mesh = DeviceMesh("cpu", torch.tensor(order))
    result = {"ok": True, "received": 0, "planned": plan.moved_bytes}
    if rank in members:  # not the lost rank
        result = _train_on(rank, members, positions, plan, layout, len(old_ranks), held, like,
                           order, survivors if scenario == "lose" else rx.global_process_set,
                           old_ranks, model, opt, new_mesh, replicated, reference,
                           reference_opt, shard, train, before)
    # the lost rank stays until the others are done: its script ending would be a rank
    # leaving the job under their collectives
    rx.allreduce(torch.zeros(1), name="done")
    dist.destroy_process_group()
    return result


def _train_on(rank, members, positions, plan, layout, old_world, held, like, order,
              process_set, old_ranks, model, opt, new_mesh, replicated, reference,
              reference_opt, shard, train, before) -> dict:
    """The new world's ranks: their rows moved, the model re-bound (a newcomer's built and
    sharded first), two more steps, compared with the unsharded model."""
    import torch
    from torch.distributed.tensor import DTensor

    from raytrain_x.torch.fsdp import rebind
    from raytrain_x.torch.reshard import reshard

    rows = reshard(plan, layout, old_world, positions[rank], len(members), held, like,
                   ranks=order, process_set=process_set)
    if rank not in old_ranks:  # the newcomer builds and shards its model as its script does
        shard(model, new_mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    rebind(model, opt, new_mesh, {t.name: r for t, r in zip(layout, rows)}, replicated)
    after = _gathered(model, opt)  # whole again, over the new mesh
    same = before is None or (before.keys() == after.keys() and all(
        torch.equal(before[k], after[k]) for k in before))
    for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        train(reference, reference_opt, step, 0, 1)
        train(model, opt, step, positions[rank], len(members))
    want = dict(reference.named_parameters())
    diff = max((p.full_tensor() if isinstance(p, DTensor) else p).sub(want[n]).abs().max().item()
               for n, p in model.named_parameters())
    received = plan.received_by(positions[rank])
    moved = sum(int(b - a) * layout[t].row_bytes for t, _, _, a, b in received.tolist())
    return {"ok": diff < 1e-5 and same, "diff": diff, "bit_for_bit": same, "received": moved,
            "planned": plan.moved_bytes}


def _gathered(model, opt) -> dict:
    """Every parameter and optimizer state, gathered whole over the model's mesh (a
    collective of its ranks): what the test compares, never what a resize does."""
    from torch.distributed.tensor import DTensor

    out = {n: p.full_tensor() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for k, v in opt.state.get(p, {}).items():
            out[f"{n}::{k}"] = v.full_tensor() if isinstance(v, DTensor) else v.clone()
    return out


@pytest.mark.parametrize("scenario,mixed", [("grow", False), ("lose", False), ("lose", True)])
def test_fsdp2_trains_on_after_a_resize_as_the_same_global_batch_unsharded(tmp_path, scenario,
                                                                          mixed):
    """With `mixed`, under a mixed precision policy (blocks computing in float64)."""
    results = run_workers(_resize, 3, str(tmp_path / "store"), scenario, mixed, work_s=40)
    assert all(r["ok"] for r in results), results
    assert sum(r["received"] for r in results) == results[0]["planned"] > 0
