"""Elastic training of a model sharded by torch's `fully_shard` (FSDP2), in memory.

Each rank holds only its chunk of every parameter and of the optimizer state cut with it
(`raytrain_x.torch.fsdp`), so a commit keeps more than this rank's copy: the rank copies
its chunks to host memory and sends them to `replicas` peers (on other hosts first), in one
alltoall of bytes. Each commit is a numbered generation that every rank takes up only once
every rank has its copies (the exchange, then a small allreduce every rank reaches only
after its exchange); a rank whose commit broke off keeps the last generation it took up
and, when its own exchange finished, the one being committed. With `background`, the
exchange runs on the engine's thread while training goes on, and the generation is taken
up at the next commit (or before the ranks go to a new round they agreed on).

At the next round (`restore`) the survivors report which chunks they hold; the newest
generation whose every chunk some survivor holds is restored. The members are placed in
the new layout where they keep the most bytes (`raytrain_x.elastic.reshard.place_members`),
torch's default group and the model's mesh are made for that order
(`raytrain_x.torch.mesh.device_mesh`), the rows each rank lacks arrive in one alltoall
(`raytrain_x.torch.reshard`), and the model and its optimizer are bound to the new mesh
(`raytrain_x.torch.fsdp.rebind`). Nothing is gathered whole and no storage is read. When no
generation is whole, `ElasticStateLost` names the chunks whose every copy was lost.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from raytrain_x.common.errors import ConfigError, ElasticStateLost
from raytrain_x.common.process import PROCESS
from raytrain_x.core import runtime
from raytrain_x.core.objects import allgather_object, broadcast_object, max_ints
from raytrain_x.elastic.checksums import PartFiles
from raytrain_x.elastic.durable import shard_rank
from raytrain_x.elastic.reshard import (
    ShardedTensor,
    chunk_bounds,
    holders_of,
    place_members,
    plan_reshard,
    replica_holders,
    segments,
)
from raytrain_x.torch import fsdp
from raytrain_x.torch.async_ops import alltoall_async
from raytrain_x.torch.durable import load_entries, load_shards
from raytrain_x.torch.mesh import device_mesh
from raytrain_x.torch.reshard import reshard

Kind = tuple[torch.dtype, tuple[int, ...]]  # a layout entry's dtype and the dims of a row
PART = "fsdp"  # a checkpoint part's chunks, under `shards` as a ZeRO part's optimizers are


@dataclass
class Chunks:
    """One commit as this rank holds it."""

    number: int
    world: int  # the world its chunks were cut for
    layout: list[ShardedTensor]
    kinds: list[Kind]
    held: dict[int, list[torch.Tensor]]  # position -> its chunk of every layout entry
    replicated: dict[str, dict[str, Any]]  # optimizer state not cut (AdamW's step)
    copies: Any = None  # the rest of the state (buffers, samplers, attributes) as committed


@dataclass
class Exchange:
    """A commit's copies on their way to and from the replica holders."""

    gen: Chunks  # the generation committed (this rank's own chunks in it so far)
    handle: Any  # the alltoall's (`alltoall_async`)
    order: tuple[int, ...]  # the rank at each position of the round's mesh
    senders: frozenset[int]  # the ranks whose chunks this rank keeps a copy of


@dataclass
class Report:
    """What a rank holds, as `restore` gathers it."""

    taken: int = 0  # the newest generation it took up
    # (number, world) -> the positions whose chunks it holds
    generations: dict[tuple[int, int], frozenset[int]] = field(default_factory=dict)


@dataclass
class Source:
    """The generation a round restores: its number and world, who holds each position's
    chunks (ranks of the new world, lowest first) and the lowest rank holding it (it sends
    the rest of the state)."""

    number: int
    world: int
    holders: dict[int, list[int]]
    root: int


def choose_generation(reports: Sequence[Report]) -> Source:
    """The newest generation every chunk of which some rank holds, no older than the newest
    one any rank took up (a rank takes a generation up only once every rank staged it).
    Raises ElasticStateLost naming the chunks of the newest one whose every copy is gone."""
    floor = max((r.taken for r in reports), default=0)
    keys = sorted({k for r in reports for k in r.generations if k[0] >= floor}, reverse=True)
    missing: list[int] = []
    for number, world in keys:
        holders: dict[int, list[int]] = {}
        for rank, report in enumerate(reports):
            for position in report.generations.get((number, world), ()):
                holders.setdefault(position, []).append(rank)
        lacking = [p for p in range(world) if p not in holders]
        if not lacking:
            root = min(r for ranks in holders.values() for r in ranks)
            return Source(number, world, holders, root)
        missing = missing or lacking
    shown = ", ".join(map(str, missing[:8]))
    raise ElasticStateLost(
        f"every copy of the sharded model's chunks {shown} (of {len(missing)} lost) was "
        "lost with the workers that held them. Keep more copies (TorchState(..., "
        "replicas=2)), spread the workers over more nodes, or give durable checkpoints "
        "(checkpoint=CheckpointConfig(...)) to restore from")


def _as_bytes(chunks: Iterable[torch.Tensor]) -> torch.Tensor:
    flat = [c.reshape(-1).view(torch.uint8) for c in chunks if c.numel()]
    return torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)


def chunk_sizes(layout: Sequence[ShardedTensor], world: int, position: int) -> list[int]:
    """The rows of each layout entry that `position` holds in a world of `world`."""
    out = []
    for tensor in layout:
        bounds = chunk_bounds(tensor.rows, world)
        out.append(int(bounds[position + 1] - bounds[position]))
    return out


def from_bytes(data: torch.Tensor, layout: Sequence[ShardedTensor], kinds: Sequence[Kind],
               world: int, position: int) -> list[torch.Tensor]:
    """`position`'s chunks of every layout entry, cut from its bytes as `_as_bytes` laid
    them out (views of `data` where their bytes lie aligned for their dtype, else copies).

    Raises:
        ConfigError: `data` is not as long as the layout says.
    """
    sizes = [rows * t.row_bytes for t, rows in zip(layout, chunk_sizes(layout, world,
                                                                       position))]
    if sum(sizes) != data.numel():
        raise ConfigError(f"a copy of chunk {position} has {data.numel()} bytes where its "
                          f"layout has {sum(sizes)}")
    out, offset = [], 0
    for size, (dtype, dims) in zip(sizes, kinds):
        piece = data[offset:offset + size]
        if (data.storage_offset() + offset) % dtype.itemsize:
            piece = piece.clone()
        out.append(piece.view(dtype).view(-1, *dims))
        offset += size
    return out


class FSDPCommits:
    """The generations of a `TorchState` holding an FSDP2 model (see the module).

    Args:
        model: the model, wrapped by `fully_shard` (its blocks, then itself).
        optimizer: the optimizer of its parameters (None: the parameters alone).
        replicas: how many peers keep a copy of each rank's chunks.
        background: send each commit's copies while training goes on, and take the
            commit up at the next one (`settle`).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 replicas: int, background: bool = False) -> None:
        self.model = model
        self.optimizer = optimizer
        self.replicas = replicas
        self.background = background
        self._exchange: Exchange | None = None  # a commit's copies under way
        fsdp.sharded_layout(model)  # a clear error where nothing is sharded
        if fsdp.mesh_info(model).mesh.ndim != 1:
            raise ConfigError("an elastic FSDP2 model is sharded over a 1-D mesh "
                              "(rx.device_mesh()); HSDP's 2-D mesh is not re-sharded")
        self.taken = self._own(0)
        self.staged: Chunks | None = None

    def _place(self) -> tuple[int, int]:
        """This rank's position in the model's mesh, and the mesh's size."""
        info = fsdp.mesh_info(self.model)
        return info.shard_mesh_rank, info.shard_mesh_size

    def _own(self, number: int) -> Chunks:
        """This rank's chunks, copied to host memory, as generation `number`."""
        position, world = self._place()
        layout = fsdp.sharded_layout(self.model, self.optimizer)
        chunks = [c.detach().to("cpu", copy=True)
                  for c in fsdp.local_chunks(self.model, self.optimizer)]
        kinds = [(c.dtype, tuple(c.shape[1:])) for c in chunks]
        replicated = ({} if self.optimizer is None else
                      _copy(fsdp.replicated_states(self.model, self.optimizer)))
        return Chunks(number, world, layout, kinds, {position: chunks}, replicated)

    @staticmethod
    def _order() -> tuple[int, ...]:
        """The rank at each position of this round's mesh."""
        world = PROCESS.world
        if world is not None and world.mesh is not None:
            return world.mesh[0]
        return tuple(range(runtime.size()))

    def commit(self, copies: Any) -> None:
        """Phase one: this rank's chunks to its replica holders; phase two: a small
        allreduce every rank reaches only once every exchange is done; then taken. With
        `background`, phase one runs on while training goes on, and the commit before
        this one is taken up first."""
        self.settle()
        own = self._own(self.taken.number + 1)
        own.copies = copies
        hosts = [cross for _, cross in runtime.engine().groups.layout]
        mine = runtime.rank()
        holders = replica_holders(mine, hosts, self.replicas)
        data = _as_bytes(next(iter(own.held.values())))
        splits = [data.numel() if r in holders else 0 for r in range(runtime.size())]
        payload = torch.cat([data] * len(holders)) if holders and data.numel() else \
            torch.empty(0, dtype=torch.uint8)
        handle = alltoall_async(payload, splits=splits,
                                name=f"elastic.fsdp.replicas.{own.number}")
        self.staged = own
        self._exchange = Exchange(own, handle, self._order(),
                                  frozenset(holders_of(mine, hosts, self.replicas)))
        if not self.background:
            self.settle()

    def settle(self) -> None:
        """Waits for the copies of the commit under way, keeps the peers' it is sent, and
        takes the commit up once every rank has (a collective: every rank settles at the
        same commit, or before the new round the ranks agreed on)."""
        if self._exchange is None:
            return
        exchange, self._exchange = self._exchange, None
        _keep_copies(exchange, exchange.handle.wait())
        max_ints([exchange.gen.number], name=f"elastic.fsdp.taken.{exchange.gen.number}")
        self.taken, self.staged = exchange.gen, None

    def report(self) -> Report:
        exchange, self._exchange = self._exchange, None
        if exchange is not None and exchange.handle.done():  # a worker lost meanwhile
            try:
                _keep_copies(exchange, exchange.handle.wait())
            except Exception:  # noqa: BLE001 - it broke off: its own chunks are kept
                pass
        report = Report(taken=self.taken.number)
        for gen in (self.taken, self.staged):
            if gen is not None:
                report.generations[(gen.number, gen.world)] = frozenset(gen.held)
        return report

    def newest(self) -> Chunks:
        """The newest generation this rank committed: the one under way (`background`),
        or the one it took up."""
        return self.staged or self.taken

    def held(self, number: int, world: int) -> Chunks | None:
        return next((g for g in (self.taken, self.staged) if g is not None
                     and (g.number, g.world) == (number, world)), None)

    def keep(self, copies: Any) -> None:
        """The rest of the state as this rank holds it now (the initial state)."""
        self.taken.copies = copies

    def committed(self) -> Any:
        """The rest of the state as committed with the newest generation."""
        return self.newest().copies

    def restore(self) -> int:
        """At a new round: agree on the generation, place the members, make the round's
        mesh in their order, move the rows each lacks and bind the model and optimizer
        to the mesh. Returns the rank holding the rest of the state."""
        reports = allgather_object(self.report(), name="elastic.fsdp.report")
        source = choose_generation(reports)
        rank, size = runtime.rank(), runtime.size()
        gen = self.held(source.number, source.world)
        meta = None
        if rank == source.root:
            assert gen is not None
            positions = place_members(gen.layout, source.world, source.holders,
                                      list(range(size)))
            meta = (gen.layout, gen.kinds, gen.replicated, positions)
        layout, kinds, replicated, positions = broadcast_object(
            meta, source.root, name=f"elastic.fsdp.layout.{source.number}")
        order = [0] * size
        for member, position in positions.items():
            order[position] = member
        at = {j: [positions[r] for r in ranks] for j, ranks in source.holders.items()}
        plan = plan_reshard(layout, source.world, size, at)
        mesh = device_mesh(order)
        like = [torch.empty((0, *dims), dtype=dtype) for dtype, dims in kinds]
        rows = reshard(plan, layout, source.world, positions[rank], size,
                       gen.held if gen is not None else {}, like,
                       name=f"elastic.fsdp.reshard.{source.number}", ranks=order)
        fsdp.rebind(self.model, self.optimizer, mesh,
                    {t.name: r for t, r in zip(layout, rows)}, replicated)
        self.taken = Chunks(source.number, size, list(layout), list(kinds),
                            {positions[rank]: rows}, replicated,
                            gen.copies if gen is not None else None)
        self.staged = None
        return source.root

    def own_part(self) -> dict[str, Any]:
        """This rank's chunks of the newest generation, as its checkpoint part: every
        layout entry's rows (`shards`, by entry), with the layout, the world's order and
        the optimizer state not cut (a checkpoint needs no copy on a peer)."""
        gen, position = self.newest(), self._place()[0]
        return {"rank": runtime.rank(), "position": position, "world": gen.world,
                "order": list(self._order()),
                "layout": [[t.name, t.rows, t.row_bytes] for t in gen.layout],
                "kinds": [[str(dtype).removeprefix("torch."), list(dims)]
                          for dtype, dims in gen.kinds],
                "replicated": gen.replicated,
                "shards": {PART: {i: {"rows": c} for i, c in enumerate(gen.held[position])}}}

    def restore_from(self, parts: Iterable[PartFiles]) -> None:
        """From storage, at any world size: this rank's chunks in this world's layout (its
        rank order), read from the parts whose chunks overlap them, each entry's chunk
        alone (checked as it is read); then the model and optimizer bound to the round's
        mesh."""
        by_rank = {shard_rank(p.folder): p for p in parts}
        if not by_rank:
            raise ConfigError("the checkpoint holds no chunks of the sharded model")
        head = load_entries(next(iter(by_rank.values())),
                            ["order", "world", "layout", "kinds", "replicated"])
        order, world = head["order"], int(head["world"])
        layout = [ShardedTensor(str(n), int(r), int(b)) for n, r, b in head["layout"]]
        kinds = [(getattr(torch, d), tuple(dims)) for d, dims in head["kinds"]]
        rank, size = runtime.rank(), runtime.size()
        wanted: dict[int, set[int]] = {}  # old position -> the entries whose rows it gives
        for index, tensor in enumerate(layout):
            _, _, owner, dest = segments(tensor.rows, world, size)
            for old in set(owner[dest == rank].tolist()):
                wanted.setdefault(old, set()).add(index)
        read: dict[int, dict[int, torch.Tensor]] = {}
        for old, indices in wanted.items():
            got = load_shards(by_rank[order[old]],
                              lambda name, i, chosen=indices: name == PART and i in chosen)
            read[old] = {i: entry["rows"] for i, entry in got.get(PART, {}).items()}
        rows = []
        for index, (tensor, (dtype, dims)) in enumerate(zip(layout, kinds)):
            olds, news = chunk_bounds(tensor.rows, world), chunk_bounds(tensor.rows, size)
            first, last = int(news[rank]), int(news[rank + 1])
            out = torch.empty((last - first, *dims), dtype=dtype)
            for old, entries in read.items():
                low, high = max(first, int(olds[old])), min(last, int(olds[old + 1]))
                if index in entries and low < high:
                    out[low - first:high - first] = entries[index][low - olds[old]:
                                                                   high - olds[old]]
            rows.append(out)
        replicated = head["replicated"]
        fsdp.rebind(self.model, self.optimizer, device_mesh(),
                    {t.name: r for t, r in zip(layout, rows)}, replicated)
        self.taken = Chunks(0, size, layout, kinds, {rank: rows}, replicated)
        self.staged = None


def _keep_copies(exchange: Exchange, received: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Adds the peers' chunks this rank received in `exchange` to its generation."""
    got, counts = received
    gen, offset = exchange.gen, 0
    for sender, count in enumerate(counts.tolist()):
        if sender in exchange.senders:
            peer = exchange.order.index(sender)
            gen.held[peer] = from_bytes(got[offset:offset + count], gen.layout, gen.kinds,
                                        gen.world, peer)
        offset += count


def _copy(states: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: {k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v
                   for k, v in state.items()} for name, state in states.items()}
