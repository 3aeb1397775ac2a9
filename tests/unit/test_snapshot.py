"""Host snapshots of a state (what an elastic commit keeps): reused buffers, never one a
reader still holds, and a structure `load_state_dict` takes back."""

from __future__ import annotations

import torch

from raytrain_x.comm.torch_backend import TorchGroup
from raytrain_x.torch.snapshot import Snapshots


def _state() -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "opt": opt.state_dict(), "epoch": [1, {"b": 2}]}


def test_a_snapshot_is_a_copy_that_later_changes_do_not_touch():
    tree = _state()
    snap = Snapshots().take(tree)
    weight = tree["model"]["0.weight"]
    kept = weight.clone()
    weight.add_(1.0)
    tree["epoch"][1]["b"] = 9
    assert torch.equal(snap.tree()["model"]["0.weight"], kept)
    assert snap.tree()["epoch"] == [1, {"b": 2}]
    assert snap.nbytes == sum(t.numel() * t.element_size()
                              for t in [*tree["model"].values(),
                                        *(v for s in tree["opt"]["state"].values()
                                          for v in s.values())])


def test_the_buffers_of_a_dropped_snapshot_are_reused_and_a_held_ones_are_not():
    pool = Snapshots()
    tree = _state()
    first = pool.take(tree)
    ptr = first.tree()["model"]["0.weight"].data_ptr()
    second = pool.take(tree)  # the first is still held: new buffers
    assert second.tree()["model"]["0.weight"].data_ptr() != ptr
    del first
    third = pool.take(tree)
    assert third.tree()["model"]["0.weight"].data_ptr() == ptr
    tree["model"]["0.weight"] = torch.zeros(2, 2)  # another shape: a buffer of its own
    del second
    fourth = pool.take(tree)
    assert fourth.tree()["model"]["0.weight"].shape == (2, 2)


def test_a_restored_copy_loads_and_owns_its_tensors():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    snap = Snapshots().take({"model": model.state_dict()})
    restored = snap.copy()["model"]
    assert getattr(restored, "_metadata", None) == model.state_dict()._metadata
    assert restored["0.weight"].data_ptr() != snap.tree()["model"]["0.weight"].data_ptr()
    with torch.no_grad():
        model[0].weight.zero_()
    model.load_state_dict(restored)
    assert torch.equal(model[0].weight, snap.tree()["model"]["0.weight"])


class _Communicator:
    aborted = 0

    def abort(self) -> None:
        self.aborted += 1


def test_a_failed_rounds_group_aborts_its_nccl_communicator_and_a_closed_one_does_not():
    for abort, expected in ((True, 1), (False, 0)):
        group = TorchGroup.__new__(TorchGroup)
        group._gloo, group._nccl = object(), _Communicator()
        nccl = group._nccl
        group.close(abort=abort)
        assert nccl.aborted == expected and group._nccl is None
