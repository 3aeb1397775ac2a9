"""Carrying out a re-shard plan (`raytrain_x.elastic.reshard`) between torch ranks: each rank
gives the chunks it holds (its own and the copies it keeps) and gets its chunk of every
tensor in the new layout. Rows it holds are copied in place; every other row arrives in one
`alltoall` of bytes (each rank sends each peer the rows the plan names, in the plan's
order, so the receiver knows where each lands without being told), over whatever carries
the job's collectives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from raytrain_x.common.errors import ConfigError
from raytrain_x.core.process_sets import ProcessSet, global_process_set
from raytrain_x.elastic.reshard import (
    DEST,
    SOURCE,
    START,
    TENSOR,
    ReshardPlan,
    ShardedTensor,
    chunk_bounds,
    segments,
)
from raytrain_x.torch.ops import alltoall


def reshard(plan: ReshardPlan, tensors: Sequence[ShardedTensor], old_world: int,
            position: int, new_world: int, held: Mapping[int, Sequence[torch.Tensor]],
            like: Sequence[torch.Tensor], name: str = "reshard",
            ranks: Sequence[int] | None = None,
            process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """This rank's chunk of every tensor in the new layout (position `position` of
    `new_world`), every rank of the new world calling it with the same plan and its own
    `held`.

    Args:
        plan: `plan_reshard`'s plan, with members at their new positions (the ranks of the
            collective's world are the positions).
        tensors: the layout the plan was made for, in its order.
        old_world: the world the chunks were cut for.
        position: this rank's position in the new layout (its rank in the new world).
        new_world: the new world's size.
        held: old chunk -> that chunk of each tensor (in `tensors` order), for every old
            chunk this rank holds.
        like: a tensor per layout entry giving the dtype and trailing dims of its rows.
        name: the collective's name.
        ranks: the rank in `process_set` of each position (None: position k is rank k).
        process_set: the ranks of the new world (default: every rank).

    Raises:
        ConfigError: a chunk the plan says this rank holds is missing, or a tensor's rows
            do not match the layout.
    """
    received, sent = plan.received_by(position), plan.sent_by(position)
    olds = [chunk_bounds(t.rows, old_world) for t in tensors]
    news = [chunk_bounds(t.rows, new_world) for t in tensors]
    out = []
    for index, (tensor, kind) in enumerate(zip(tensors, like)):
        new, first = news[index], int(news[index][position])
        rows = torch.empty((int(new[position + 1]) - first, *kind.shape[1:]), dtype=kind.dtype)
        # the pieces of this rank's new chunk that no transfer brings: it holds them
        starts, stops, owners, dests = segments(tensor.rows, old_world, new_world)
        arriving = set(received[received[:, TENSOR] == index, START].tolist())
        for start, stop, chunk in zip(*(a[dests == position].tolist()
                                        for a in (starts, stops, owners))):
            if start not in arriving:
                rows[start - first:stop - first] = _rows(held, chunk, index, tensor,
                                                         olds[index], start, stop)
        out.append(rows)
    ranks = list(range(new_world)) if ranks is None else list(ranks)
    position_of = {rank: p for p, rank in enumerate(ranks)}
    pieces, splits = [], []
    for member in range(new_world):
        dest, size = position_of[member], 0
        for t, _, _, a, b in sent[sent[:, DEST] == dest].tolist():
            chunk = int(np.searchsorted(olds[t], a, side="right") - 1)
            pieces.append(_bytes(_rows(held, chunk, t, tensors[t], olds[t], a, b)))
            size += pieces[-1].numel()
        splits.append(size)
    payload = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
    got, _ = alltoall(payload, splits=splits, name=name, process_set=process_set)
    offset = 0
    for t, _, _, a, b in sorted(received.tolist(), key=lambda r: (ranks[r[SOURCE]], r[TENSOR],
                                                                   r[START])):
        first = int(news[t][position])
        target = _bytes(out[t][a - first:b - first])
        target.copy_(got[offset:offset + target.numel()])
        offset += target.numel()
    if offset != got.numel():
        raise ConfigError(f"{name}: received {got.numel()} bytes where the plan names "
                          f"{offset}; every rank must call it with the same plan")
    return out


def _rows(held: Mapping[int, Sequence[torch.Tensor]], chunk: int, index: int,
          tensor: ShardedTensor, old: np.ndarray, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of a tensor, from the old chunk this rank holds."""
    if chunk not in held:
        raise ConfigError(f"the re-shard plan has this rank hold chunk {chunk} of "
                          f"{tensor.name!r}, which it was not given")
    rows = held[chunk][index]
    if rows.shape[0] != old[chunk + 1] - old[chunk]:
        raise ConfigError(f"chunk {chunk} of {tensor.name!r} has {rows.shape[0]} rows; its "
                          f"layout gives it {int(old[chunk + 1] - old[chunk])}")
    return rows[start - old[chunk]:stop - old[chunk]]


def _bytes(rows: torch.Tensor) -> torch.Tensor:
    """`rows` as flat bytes: a view where they lie contiguous (a row slice of a chunk),
    else a copy."""
    return rows.contiguous().view(-1).view(torch.uint8)
