"""Elastic training with sharded optimizers (`zero_stage` 1 and 2), in memory.

Each rank holds only its own parameters' optimizer state, so a commit keeps more than this
rank's copy: the rank sends its shard to `replicas` peers (on other hosts first), and each
commit is a numbered generation that every rank takes up only once every rank has its
copies (two-phase: the exchange, then an allgather that is also the generation's
directory of which parameters have state). A rank whose commit broke off keeps the last
generation it took up and, when its own exchange finished, the one being committed.

At the next round (`sync`) the survivors report what they hold; the newest generation whose
every shard some survivor holds is restored: its holders send each parameter's state to
the rank that owns it in the new world's layout, and the rest of the state comes from the
lowest rank that holds that generation. When no generation is whole, `ElasticStateLost`
names the parameters whose every copy was lost.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from raytrain_x.common.errors import ElasticStateLost
from raytrain_x.core import runtime
from raytrain_x.core.collectives import synchronize
from raytrain_x.core.objects import allgather_object
from raytrain_x.elastic.checksums import PartFiles
from raytrain_x.elastic.reshard import replica_holders
from raytrain_x.torch.async_ops import alltoall_async
from raytrain_x.torch.durable import load_shards
from raytrain_x.torch.zero_optimizer import ShardedOptimizer

Key = tuple[str, int]  # (the optimizer's name in the state, the parameter's index)


@dataclass
class Generation:
    """One commit as this rank holds it."""

    number: int
    shards: dict[Key, dict[str, Any]]  # this rank's own and its replicas' states
    directory: frozenset[Key] | None  # every parameter with state (None: not committed yet)
    copies: Any = None  # the rest of the state (models, samplers, attributes) as committed


@dataclass
class Report:
    """What a rank holds, as `sync` gathers it."""

    taken: int = 0  # the newest generation it took up
    generations: dict[int, tuple[frozenset[Key], frozenset[Key] | None]] = field(
        default_factory=dict)  # number -> (the keys it holds, the directory)


@dataclass
class Plan:
    generation: int
    root: int  # the lowest rank that holds it: the rest of the state comes from it
    senders: dict[Key, int]  # which rank sends each parameter's state


def plan_restore(reports: list[Report],
                 name_of: Callable[[Key], str] = lambda key: f"{key[0]} parameter {key[1]}",
                 ) -> Plan:
    """The newest generation that can be restored whole: no older than the newest one any
    rank took up, its directory covered by what the ranks hold. Raises ElasticStateLost
    naming (`name_of`) what is missing when there is none."""
    # a rank took a generation up only once every rank had staged it: none goes back further
    floor = max((r.taken for r in reports), default=0)
    numbers = sorted({n for r in reports for n in r.generations if n >= floor}, reverse=True)
    missing: set[Key] = set()
    for number in numbers:
        holders = [(rank, r.generations[number]) for rank, r in enumerate(reports)
                   if number in r.generations]
        directory = next((d for _, (_, d) in holders if d is not None), None)
        held: dict[Key, int] = {}
        for rank, (keys, _) in holders:
            for key in keys:
                held.setdefault(key, rank)
        wanted = directory if directory is not None else frozenset(held)
        if wanted <= held.keys():
            return Plan(number, holders[0][0], {k: held[k] for k in wanted})
        if not missing:
            missing = set(wanted - held.keys())
    names = ", ".join(name_of(key) for key in sorted(missing)[:8])
    raise ElasticStateLost(
        f"every copy of the sharded optimizer state of {len(missing)} parameter(s) ({names}) "
        "was lost with the workers that held them. Keep more copies "
        "(TorchState(..., replicas=2)), or spread the workers over more nodes")


def exchange(payloads: dict[int, Any], name: str) -> dict[int, Any]:
    """Sends each rank its object (pickled) and returns what each rank sent this one: one
    alltoall of bytes, so each shard crosses the wire once."""
    size = runtime.size()
    blobs = [pickle.dumps(payloads[r]) if r in payloads else b"" for r in range(size)]
    splits = [len(b) for b in blobs]
    flat = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8) if sum(splits) \
        else torch.empty(0, dtype=torch.uint8)
    received, counts = synchronize(alltoall_async(flat, splits=splits, name=name))
    out, offset = {}, 0
    data = received.numpy().tobytes()
    for r, n in enumerate(counts.tolist()):
        if n:
            out[r] = pickle.loads(data[offset:offset + n])
        offset += n
    return out


class ShardedCommits:
    """The generations of a `TorchState` that holds sharded optimizers (see the module)."""

    def __init__(self, optimizers: dict[str, ShardedOptimizer], replicas: int) -> None:
        self.optimizers = optimizers
        self.replicas = replicas
        self.taken = Generation(0, self._own(), None)
        self.staged: Generation | None = None  # being committed; complete on this rank

    def _own(self) -> dict[Key, dict[str, Any]]:
        return {(name, i): s for name, opt in self.optimizers.items()
                for i, s in opt.shard_state().items()}

    def commit(self, copies: Any) -> None:
        """Phase one: this rank's shard to its replica holders; phase two: the directory
        (an allgather every rank reaches only once every exchange is done); then taken."""
        own = self._own()
        number = self.taken.number + 1
        hosts = [cross for _, cross in runtime.engine().groups.layout]
        mine = runtime.rank()
        received = exchange({r: own for r in replica_holders(mine, hosts, self.replicas)},
                            name=f"elastic.zero.replicas.{number}")
        shards = dict(own)
        for part in received.values():
            shards.update(part)
        self.staged = Generation(number, shards, None, copies)
        every = allgather_object(sorted(own), name=f"elastic.zero.directory.{number}")
        self.staged.directory = frozenset(k for keys in every for k in keys)
        self.taken, self.staged = self.staged, None

    def report(self) -> Report:
        report = Report(taken=self.taken.number)
        for gen in (self.taken, self.staged):
            if gen is not None:
                report.generations[gen.number] = (frozenset(gen.shards), gen.directory)
        return report

    def _name_of(self, key: Key) -> str:
        """A parameter's name as the user gave it (`named_parameters`), and its optimizer."""
        name, index = key
        return f"{self.optimizers[name].parameter_name(index)!r} of {name}"

    def held(self, number: int) -> Generation | None:
        return next((g for g in (self.taken, self.staged) if g is not None
                     and g.number == number), None)

    def keep(self, copies: Any) -> None:
        """The rest of the state as this rank holds it now (the initial state)."""
        self.taken.copies = copies

    def settle(self) -> None:
        """Nothing: a commit's copies have landed when `commit` returns."""

    def committed(self) -> Any:
        """The rest of the state as committed with the generation this rank took up."""
        return self.taken.copies

    def own_part(self) -> dict[str, Any]:
        """This rank's own shards (by optimizer and parameter index) of the generation it
        took up: its checkpoint part."""
        rank = runtime.rank()
        owners = {(name, i): r for name, opt in self.optimizers.items()
                  for i, r in opt.owners_by_index().items()}
        own: dict[str, dict[int, Any]] = {}
        for (name, index), shard in self.taken.shards.items():
            if owners.get((name, index)) == rank:
                own.setdefault(name, {})[index] = shard
        return {"rank": rank, "shards": own}

    def restore_from(self, parts: Iterable[PartFiles]) -> None:
        """From storage: re-shards every optimizer for this world and reads only the shards
        this rank owns in it from the checkpoint's shard parts (each checked as it is
        read)."""
        rank = runtime.rank()
        for opt in self.optimizers.values():
            opt.reshard()
        owners = {name: opt.owners_by_index() for name, opt in self.optimizers.items()}
        shards: dict[str, dict[int, Any]] = {}
        for part in parts:
            mine = load_shards(part, lambda name, i: owners.get(name, {}).get(i) == rank)
            for name, states in mine.items():
                shards.setdefault(name, {}).update(states)
        for name, opt in self.optimizers.items():
            opt.load_shard_state(shards.get(name, {}))
        self.taken = Generation(0, self._own(), None, None)
        self.staged = None

    def restore(self) -> int:
        """At a new round: agree on the generation, re-shard every optimizer for the new
        world and send each parameter's state to its new owner. Returns the plan's root
        (the lowest rank holding the generation: it sends the rest of the state)."""
        reports = allgather_object(self.report(), name="elastic.zero.report")
        plan = plan_restore(reports, self._name_of)
        mine = runtime.rank()
        generation = self.held(plan.generation)
        payloads: dict[int, dict[Key, dict[str, Any]]] = {}
        owners = {}
        for name, opt in self.optimizers.items():
            opt.reshard()  # the new layout: who owns what
            owners.update({(name, i): r for i, r in opt.owners_by_index().items()})
        for key, sender in plan.senders.items():
            if sender == mine and generation is not None:
                payloads.setdefault(owners[key], {})[key] = generation.shards[key]
        received = exchange(payloads, name=f"elastic.zero.reshard.{plan.generation}")
        states: dict[Key, dict[str, Any]] = {}
        for part in received.values():
            states.update(part)
        for name, opt in self.optimizers.items():
            opt.load_shard_state({i: s for (n, i), s in states.items() if n == name})
        kept = generation if generation is not None else Generation(plan.generation, {}, None)
        self.taken = Generation(plan.generation, self._own(), kept.directory, kept.copies)
        self.staged = None
        return plan.root
