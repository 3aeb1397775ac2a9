"""An FSDP2 model's commits sent in the background (`TorchState(...,
commit_in_background=True)`): `commit()` returns once this rank's chunks are copied to host
memory, training goes on while the copies travel to their peers on the engine's thread,
and the commit is taken up at the next one, each rank then holding its peer's chunks as
they were at that commit, bit for bit; a commit at which the hosts changed is taken up
before the ranks go to the new round (a drained rank's copies land before it leaves)."""

from __future__ import annotations

from tests.workers import run_workers


def _commits(path: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import raytrain_x.torch as rx
    from raytrain_x.torch.fsdp import local_chunks

    rx.init()
    rank = rx.rank()
    dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    mesh = rx.device_mesh()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = rx.elastic.TorchState(model, opt, replicas=1, commit_in_background=True)
    shards = state._shards

    def step(seed: int) -> None:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed + rank))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    out = {}
    step(0)
    state.commit()  # commit 1: its copies on their way
    at_commit = [c.clone() for c in local_chunks(model, opt)]
    out["under_way"] = (shards.taken.number, shards.staged.number,
                        sorted(shards.staged.held))
    step(1)  # training goes on while they travel
    state.commit()  # commit 1 taken up; commit 2 on its way
    out["taken_up"] = (shards.taken.number, shards.staged.number, sorted(shards.taken.held))
    peers = rx.allgather_object(at_commit, name="test.chunks")
    kept = shards.taken.held[1 - rank]
    out["peer_bit_for_bit"] = len(kept) == len(peers[1 - rank]) and all(
        torch.equal(a, b) for a, b in zip(kept, peers[1 - rank]))
    out["own_part"] = shards.own_part()["shards"]["fsdp"][0]["rows"].equal(
        shards.staged.held[rank][0])  # a checkpoint writes the newest commit
    # the driver has new hosts: the commit raising it is taken up before the new round
    from raytrain_x.common.errors import HostsUpdatedInterrupt
    from raytrain_x.core import runtime

    version = runtime.rendezvous().hosts_version
    runtime.set_host_update_probe(lambda: (version + 1, False))
    step(2)
    try:
        state.commit()
    except HostsUpdatedInterrupt:
        out["before_round"] = (shards.taken.number, shards.staged, sorted(shards.taken.held))
    dist.destroy_process_group()
    return out


def test_a_background_commit_is_taken_up_at_the_next_one_with_its_peers_copies(tmp_path):
    results = run_workers(_commits, 2, str(tmp_path / "store"), work_s=30)
    for rank, result in enumerate(results):
        assert result["under_way"] == (0, 1, [rank]), result  # only its own chunks so far
        assert result["taken_up"] == (1, 2, [0, 1]), result  # and the peer's, once taken
        assert result["peer_bit_for_bit"] and result["own_part"], result
        assert result["before_round"] == (3, None, [0, 1]), result
