"""How the sharded optimizer lays parameters out: every parameter owned once, whole, and
buckets whose ranks' shares are close to even, so that the flat buffers (parameters,
gradients, what crosses the wire) carry little padding."""

from __future__ import annotations

import pytest
import torch

from raytrain_x.torch.workloads import GPTDecoder
from raytrain_x.torch.zero_layout import (
    SLACK,
    STRETCH,
    PassBuffers,
    make_buckets,
    plan_buckets,
)


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("layers,width", [(6, 512), (8, 1024)])
def test_gpt_buckets_are_padded_little_and_every_parameter_owned_once(size, layers, width):
    with torch.device("meta"):  # shapes only: nothing allocated
        params = list(GPTDecoder(layers=layers, width=width).parameters())
    plans = plan_buckets(params, 25 << 20, size)
    placed = [p for group, _ in plans for p in group]
    assert sorted(map(id, placed)) == sorted(map(id, params))
    total = sum(p.numel() for p in params)
    padded = 0
    for group, owner in plans:
        shares = [sum(p.numel() for p in group if owner[id(p)] == r) for r in range(size)]
        padded += max(shares) * size
        # every bucket but the last is within the slack, or stretched to its limit
        if group is not plans[-1][0]:
            elements = sum(shares)
            assert max(shares) * size <= (1 + SLACK) * elements or \
                elements * 4 >= STRETCH * (25 << 20)
    assert padded / total < 1.1, padded / total


def test_the_flat_buffers_hold_the_parameters_values_in_their_places():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    before = [p.detach().clone() for p in model.parameters()]
    buckets = make_buckets(list(model.parameters()), 64, 3, 1, grads_in_place=True)
    for p, value in zip(model.parameters(), before):
        assert torch.equal(p.detach(), value)
        bucket = next(b for b in buckets if any(q is p for q in b.params))
        assert p.data_ptr() == bucket.view(bucket.flat_params, p).data_ptr()
    assert sum(len(b.mine) for b in buckets) == sum(
        1 for b in buckets for p in b.params if any(p is q for q in b.mine))


def test_stage_2_pass_buffers_are_kept_and_lent_two_at_a_time():
    """Two buffers, as large as the largest bucket, lent to buckets and kept once given
    back; a third waits (None) unless it must be made beyond the count, and is not kept."""
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16, bias=False) for _ in range(6)])
    buckets = make_buckets(list(model.parameters()), 2048, 2, 0, grads_in_place=False)
    assert len(buckets) >= 3
    pool = PassBuffers(buckets, count=2)
    largest = max(b.flat_params.numel() for b in buckets)
    first, second = pool.take(buckets[0]), pool.take(buckets[1])
    assert first.numel() == buckets[0].flat_params.numel()
    assert first.untyped_storage().nbytes() == largest * 4
    assert pool.take(buckets[2]) is None  # both lent
    extra = pool.take(buckets[2], beyond_count=True)
    pool.give_back(buckets[0])
    again = pool.take(buckets[2])
    assert again.data_ptr() == first.data_ptr()  # the same memory, step after step
    pool.give_back(buckets[2])  # the older of bucket 2's two: the extra, not kept
    assert pool.take(buckets[1]) is None  # one lent to bucket 1, one to bucket 2
    pool.give_back(buckets[1])
    pool.give_back(buckets[2])
    assert sorted(t.data_ptr() for t in pool.free[(torch.float32, torch.device("cpu"))]) == \
        sorted([first.data_ptr(), second.data_ptr()])
    assert extra is not None and not pool.lent


def test_stage_2_pass_buffers_off_the_host_are_fresh_each_pass():
    """Off host memory (a GPU's caching allocator reuses freed blocks) every pass takes a
    fresh buffer, never waits, and none outlives its reduction."""
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(16, 16, bias=False) for _ in range(6)])
    buckets = make_buckets(list(model.parameters()), 2048, 2, 0, grads_in_place=False)
    pool = PassBuffers(buckets, count=2)
    taken = [pool.take(b) for b in buckets for _ in range(2)]
    assert all(t is not None and t.device.type == "meta" for t in taken)
    assert [t.numel() for t in taken[::2]] == [b.flat_params.numel() for b in buckets]
    assert not pool.lent
