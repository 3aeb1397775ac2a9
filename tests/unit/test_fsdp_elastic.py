"""The pure parts of elastic FSDP2 (`raytrain_x.torch.fsdp_elastic`): which generation a
round restores from the survivors' reports, how a rank's chunks travel as bytes, and who
keeps whose copies."""

from __future__ import annotations

import pytest
import torch

from raytrain_x.common.errors import ElasticStateLost
from raytrain_x.elastic.reshard import ShardedTensor, chunk_bounds, holders_of, replica_holders
from raytrain_x.torch.fsdp_elastic import (
    Report,
    _as_bytes,
    choose_generation,
    chunk_sizes,
    from_bytes,
)


def _report(taken, **generations):
    """generations: "g<number>_<world>" -> positions held."""
    held = {}
    for key, positions in generations.items():
        number, world = key[1:].split("_")
        held[(int(number), int(world))] = frozenset(positions)
    return Report(taken, held)


def test_the_newest_generation_whose_every_chunk_is_held_is_restored():
    # rank 2 of 3 died; rank 0 keeps its copy (replicas=1 in a ring: r+1 holds r's)
    reports = [_report(5, g5_3={0, 2}), _report(5, g5_3={1, 0})]
    source = choose_generation(reports)
    assert (source.number, source.world, source.root) == (5, 3, 0)
    assert source.holders == {0: [0, 1], 1: [1], 2: [0]}


def test_a_generation_being_committed_is_taken_where_whole_else_the_one_before():
    whole = [_report(5, g5_3={0, 2}, g6_3={0, 2}), _report(5, g5_3={1, 0}, g6_3={1, 0})]
    assert choose_generation(whole).number == 6
    # rank 1's exchange of 6 broke off: chunk 1 of 6 has no copy; 5 is whole
    broken = [_report(5, g5_3={0, 2}, g6_3={0, 2}), _report(5, g5_3={1, 0})]
    assert choose_generation(broken).number == 5


def test_nothing_older_than_a_generation_some_rank_took_up_is_restored():
    # rank 1 took 6 up (every rank had staged it); rank 0 still reports 5 whole
    reports = [_report(5, g5_2={0, 1}), _report(6, g6_2={1})]
    with pytest.raises(ElasticStateLost, match="chunks 0"):
        choose_generation(reports)


def test_initial_states_of_other_worlds_do_not_mix():
    # two survivors of a world of 3 that never committed, and a newcomer's initial state
    # cut for its own world of 3 at position 2: generation 0 of both, one world each
    survivors = [_report(0, g0_3={0}), _report(0, g0_3={1})]
    newcomer = Report(0, {(0, 3): frozenset({2})})
    assert choose_generation([*survivors, newcomer]).holders == {0: [0], 1: [1], 2: [2]}
    alone = [_report(0, g0_4={0}), _report(0, g0_4={1}), Report(0, {(0, 3): frozenset({2})})]
    with pytest.raises(ElasticStateLost, match="chunks 2, 3"):
        choose_generation(alone)


def test_losing_every_copy_names_the_chunks_and_what_to_do():
    with pytest.raises(ElasticStateLost, match=r"chunks 1 .*replicas=2.*CheckpointConfig"):
        choose_generation([_report(3, g3_2={0})])


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_a_rank_s_chunks_travel_as_bytes_and_come_back_as_they_were(world):
    layout = [ShardedTensor("a", 7, 3 * 4), ShardedTensor("a::exp_avg", 7, 3 * 4),
              ShardedTensor("b", 2, 2), ShardedTensor("c", 0, 8)]
    kinds = [(torch.float32, (3,)), (torch.float32, (3,)), (torch.bfloat16, ()),
             (torch.float64, ())]
    for position in range(world):
        rows = chunk_sizes(layout, world, position)
        assert rows == [int(b[position + 1] - b[position]) for b in
                        (chunk_bounds(t.rows, world) for t in layout)]
        chunks = [torch.randn(n, *dims).to(dtype) for n, (dtype, dims) in zip(rows, kinds)]
        back = from_bytes(_as_bytes(chunks).clone(), layout, kinds, world, position)
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(chunks, back))


def test_bytes_of_another_layout_are_refused():
    layout = [ShardedTensor("a", 4, 4)]
    with pytest.raises(Exception, match="has 3 bytes where its layout has 8"):
        from_bytes(torch.zeros(3, dtype=torch.uint8), layout, [(torch.float32, ())], 2, 0)


@pytest.mark.parametrize("hosts,replicas", [([0, 0, 1, 1], 1), ([0, 1, 2], 2),
                                            ([0, 0, 0], 1), ([0, 1], 1)])
def test_each_rank_keeps_copies_of_exactly_the_ranks_that_send_it_theirs(hosts, replicas):
    for rank in range(len(hosts)):
        kept = holders_of(rank, hosts, replicas)
        assert kept == [r for r in range(len(hosts)) if rank in
                        replica_holders(r, hosts, replicas)]
