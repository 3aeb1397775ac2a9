"""`ElasticSampler`'s accounting (pure logic: the world's size and this rank are set by hand,
as a reset would find them): Horovod's fields and state dict, exact records, and a
`record_batch` past the end of the shard that still records."""

from __future__ import annotations

import random

import pytest

from raytrain_x.torch import elastic_sampler
from raytrain_x.torch.elastic_sampler import ElasticSampler


@pytest.fixture
def world(monkeypatch):
    """Sets the world's size and this rank the sampler reads at each reset."""
    place = {"size": 2, "rank": 0}
    monkeypatch.setattr(elastic_sampler, "size", lambda: place["size"])
    monkeypatch.setattr(elastic_sampler, "rank", lambda: place["rank"])
    return place


def test_horovods_fields_and_state_dict(world):
    sampler = ElasticSampler(range(20), seed=3)
    order = list(range(20))
    random.Random(3).shuffle(order)  # Horovod's order: every index, shuffled by seed+epoch
    assert sampler.remaining_indices == order and sampler.processed_num == 0
    for batch in range(3):
        sampler.record_batch(batch, 2)
    assert sampler.processed_num == 12  # 3 batches of 2 on each of 2 ranks
    state = sampler.state_dict()
    assert (state["epoch"], state["processed_num"]) == (0, 12)
    # a state dict of Horovod's shape: its first processed_num samples of the order
    other = ElasticSampler(range(20), seed=3)
    other.load_state_dict({"epoch": 0, "processed_num": 12})
    assert other.processed_indices == set(order[:12]) == sampler.processed_indices
    assert other.remaining_indices == order[12:]
    other.set_epoch(1)
    assert other.processed_num == 0 and other.epoch == 1


def test_a_batch_index_past_the_shard_records_the_next_batch_not_nothing(world):
    """A script that keeps counting its batches across a reset (Horovod counts samples,
    so any index works) recorded nothing here: its accounting was lost."""
    sampler = ElasticSampler(range(20), shuffle=False)
    for batch in range(3):
        sampler.record_batch(batch, 2)
    world["size"] = 3  # a reset to 3 workers: 8 samples left, 3 per rank
    sampler.reset()
    assert sampler.num_samples == 3
    sampler.record_batch(3, 2)  # counted on from before the reset
    assert sampler.processed_num == 12 + 2 * 3
    assert sampler.processed_indices == set(range(18))  # the next ones in order
    sampler.record_batch(4, 2)  # the last 2, then nothing is left (and a warning)
    sampler.record_batch(5, 2)
    assert sampler.processed_num == 20


def test_records_within_the_shard_stay_exact_after_a_reset(world):
    sampler = ElasticSampler(range(12), shuffle=False)
    sampler.record_batch(0, 1)  # rank 0 took 0, rank 1 took 1
    world["size"], world["rank"] = 3, 2
    sampler.reset()
    assert sampler.remaining_indices == list(range(2, 12))
    assert list(sampler) == [4, 7, 10, 3]  # position 2, 5, 8, then padding from the start
    sampler.record_batch(1, 1)  # the second batch: positions 3, 4, 5 of what was left
    assert sampler.processed_indices == {0, 1, 5, 6, 7}
