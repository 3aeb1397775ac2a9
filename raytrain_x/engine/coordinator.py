"""Negotiation: which tensors are ready on every member, and do the ranks agree on them.

The coordinator is replicated: in a negotiating cycle every rank receives every rank's
report (one allgather, rank order) and feeds them to its own `Coordinator`, so all ranks
compute the same responses in the same order without a second round trip from rank 0.
Decisions that rank 0 alone may take (knob changes) travel in rank 0's report; stall
decisions use ages carried in the reports, never a local clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from raytrain_x.engine.messages import ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, Meta, Response


@dataclass
class Report:
    """What one rank says in a negotiating cycle."""

    rank: int
    requests: list[tuple[str, Meta]] = field(default_factory=list)
    stalled: dict[str, float] = field(default_factory=dict)  # name -> seconds pending
    knobs: dict[str, Any] | None = None  # honoured from rank 0 only
    join: bool = False


@dataclass
class Decision:
    responses: list[Response]
    warnings: list[str]
    knobs: dict[str, Any] | None


class Coordinator:
    """Tracks partially submitted names and turns complete ones into responses.

    Args:
        members_of: process set id -> its member ranks (raises for unknown ids).
        stall_shutdown_s: a name pending this long on some rank fails (0 = only warn).
    """

    def __init__(self, members_of: Callable[[int], list[int]], stall_shutdown_s: float = 0.0):
        self._members_of = members_of
        self._stall_shutdown_s = stall_shutdown_s
        self.table: dict[str, dict[int, Meta]] = {}
        self.joined: list[int] = []

    def forget(self, names: Iterable[str]) -> None:
        """Drops names completed without negotiation (response-cache hits); the
        negotiator calls it only while the table holds names (not in the steady state)."""
        for name in names:
            self.table.pop(name, None)

    def process(self, reports: list[Report]) -> Decision:
        for rep in reports:
            for name, meta in rep.requests:
                self.table.setdefault(name, {})[rep.rank] = meta
            if rep.join and rep.rank not in self.joined:
                self.joined.append(rep.rank)
        responses: list[Response] = []
        for name, by_rank in list(self.table.items()):
            response = self._try_complete(name, by_rank)
            if response is not None:
                del self.table[name]
                responses.append(response)
        warnings = self._stalls(reports, responses)
        return Decision(responses, warnings, reports[0].knobs if reports else None)

    def _try_complete(self, name: str, by_rank: dict[int, Meta]) -> Response | None:
        first = next(iter(by_rank.values()))
        try:
            members = self._members_of(first.process_set_id)
        except Exception as exc:  # unknown process set: fail the tensor, not the engine
            return Response(name, first, error=str(exc))
        outsiders = sorted(set(by_rank) - set(members))
        if outsiders:
            return Response(name, first, error=(
                f"tensor {name!r}: ranks {outsiders} submitted it but are not in process set "
                f"{first.process_set_id} (members {members})"))
        joined = [r for r in self.joined if r in members and r not in by_rank]
        if joined and first.kind != ALLREDUCE:
            return Response(name, first, error=(
                f"tensor {name!r}: ranks {joined} have joined; only allreduce can run while "
                "ranks are joined"))
        if not set(members) <= set(by_rank) | set(joined):
            return None
        return _agree(name, by_rank, members)

    def _stalls(self, reports: list[Report], done: list[Response]) -> list[str]:
        warnings: list[str] = []
        finished = {r.name for r in done}
        ages: dict[str, float] = {}
        for rep in reports:
            for name, age in rep.stalled.items():
                if name not in finished:
                    ages[name] = max(age, ages.get(name, 0.0))
        for name, age in ages.items():
            by_rank = self.table.get(name, {})
            first = next(iter(by_rank.values()), None)
            members = self._members_of(first.process_set_id) if first else []
            missing = [r for r in members if r not in by_rank and r not in self.joined]
            warnings.append(
                f"tensor {name!r} has waited {age:.0f}s: ranks {sorted(by_rank)} submitted it, "
                f"ranks {missing} did not. One rank is skipping a collective or is stuck.")
            if self._stall_shutdown_s and age >= self._stall_shutdown_s and first is not None:
                del self.table[name]
                done.append(Response(name, first, error=(
                    f"tensor {name!r} stalled for {age:.0f}s: ranks {missing} never submitted "
                    "it (stall_shutdown_time_s reached)")))
        return warnings


def _describe(meta: Meta) -> str:
    text = f"{meta.kind} {meta.dtype}{list(meta.shape)}"
    if meta.op:
        text += f" op={meta.op}"
    if meta.kind == "broadcast":
        text += f" root={meta.root}"
    if meta.prescale != 1.0 or meta.postscale != 1.0:
        text += f" scale={meta.prescale:g}/{meta.postscale:g}"
    if meta.wire_dtype:
        text += f" wire={meta.wire_dtype}"
    if meta.framework:
        text += f" from {meta.framework}"
    return text


def _agreed_part(meta: Meta) -> Meta:
    """The fields that must match: for allgather/alltoall dim 0 and splits may differ."""
    if meta.kind in (ALLGATHER, ALLTOALL):
        return Meta(meta.kind, meta.dtype, meta.shape[1:], meta.op, meta.root, meta.prescale,
                    meta.postscale, meta.process_set_id, meta.wire_dtype, meta.device,
                    framework=meta.framework)
    if meta.kind == BARRIER:
        return Meta(meta.kind, "", (), process_set_id=meta.process_set_id)
    return meta


def _agree(name: str, by_rank: dict[int, Meta], members: list[int]) -> Response:
    present = [r for r in members if r in by_rank]
    reference = by_rank[present[0]]
    groups: dict[Meta, list[int]] = {}
    for r in present:
        groups.setdefault(_agreed_part(by_rank[r]), []).append(r)
    if len(groups) > 1:
        parts = "; ".join(f"ranks {ranks} have {_describe(by_rank[ranks[0]])}"
                          for ranks in groups.values())
        if len({m.framework for m in groups}) > 1:
            advice = ("Every rank of a job must send a collective from the same framework "
                      "(all raytrain_x.torch or all raytrain_x.tensorflow).")
        else:
            advice = ("Every rank must submit the same shape, dtype and op for a name "
                      "(allgather/alltoall: the same trailing dims).")
        return Response(name, reference,
                        error=f"ranks disagree on tensor {name!r}: {parts}. {advice}")
    if reference.kind == ALLGATHER:
        return Response(name, reference, rank_dims=tuple(by_rank[r].shape[0] for r in members))
    if reference.kind == ALLTOALL:
        splits = tuple(by_rank[r].splits for r in members)
        bad = [r for r, s in zip(members, splits) if len(s) != len(members)]
        if bad:
            return Response(name, reference, error=(
                f"alltoall {name!r}: ranks {bad} gave splits of the wrong length; give one "
                f"split per member ({len(members)})"))
        return Response(name, reference, rank_dims=splits)
    return Response(name, reference)
