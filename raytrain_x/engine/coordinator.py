"""Negotiation: which tensors are ready on every member, and do the ranks agree on them.

Rank 0 coordinates, as Horovod's controller does: in a negotiating cycle it gathers every
rank's report, feeds them to its `Coordinator` and broadcasts the decision, so the other
ranks do O(T) work a cycle (their report, the decision), not O(N x T). Ranks that report
the same thing (most do: the same tensors, in the same order) are one report with the set
of ranks that sent it, and the table keeps a set of ranks per name and layout, so the
coordinator's work grows with the distinct reports, not with N. The one number a rank may
give alone (an allgather's dim 0: each rank its own rows) travels beside its report, not
in it (`frame_report`), so those reports stay alike and the numbers go as arrays.
Decisions that rank 0 alone may take (knob changes) travel in rank 0's report; stall
decisions use ages carried in the reports, never a local clock.
"""

from __future__ import annotations

import pickle
import struct
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from operator import itemgetter
from typing import Any

import numpy as np

from raytrain_x.engine.messages import ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, Meta, Response


@dataclass
class Report:
    """What one rank says in a negotiating cycle."""

    rank: int  # the sender; -1 in a report sent for every rank that sends the same
    requests: list[tuple[str, Meta]] = field(default_factory=list)
    stalled: dict[str, float] = field(default_factory=dict)  # name -> seconds pending
    knobs: dict[str, Any] | None = None  # honoured from rank 0 only
    join: bool = False
    # the members of each process set its requests name (but the global set), as this rank
    # registered it: rank 0 decides for a set it has not registered yet (a process set is
    # registered by each rank on its own, and its members may submit before rank 0 has)
    sets: dict[int, tuple[int, ...]] = field(default_factory=dict)


# an allgather's dim 0 in a framed report's layout: the rank's own rows travel beside it
OWN_ROWS = -1
_LENGTH = struct.Struct("<q")


def frame_report(report: Report) -> bytes:
    """`report` as a rank sends it: the pickled report with every allgather's dim 0 taken
    out (`OWN_ROWS`), then those dims as int64, in request order. Ranks that differ only
    in their rows send the same report bytes (`group_reports` counts them once)."""
    rows = [meta.shape[0] for _, meta in report.requests
            if meta.kind == ALLGATHER and meta.shape]
    if rows:
        report = replace(report, requests=[
            (name, replace(meta, shape=(OWN_ROWS, *meta.shape[1:]))
             if meta.kind == ALLGATHER and meta.shape else meta)
            for name, meta in report.requests])
    body = pickle.dumps(report)
    return b"".join((_LENGTH.pack(len(body)), body, array("q", rows).tobytes()))


@dataclass
class Rows:
    """The ranks that sent one report and each one's rows: row i of `values` is rank
    `ranks[i]`'s, one column per allgather of the report, in its order."""

    ranks: np.ndarray
    values: np.ndarray


def group_reports(blobs: list[bytes]) -> list[tuple[int, Report, Rows]]:
    """Every rank's framed report (rank order) as the distinct reports, each with the
    ranks that sent it (a rank set) and their rows."""
    senders: dict[bytes, tuple[list[int], list[bytes]]] = {}
    for rank, blob in enumerate(blobs):
        start = _LENGTH.size + _LENGTH.unpack_from(blob)[0]
        # a report without rows is its own key: no copy (a report has rows or not alike
        # on every rank that sends it)
        key = blob if start == len(blob) else blob[:start]
        sent = senders.setdefault(key, ([], []))
        sent[0].append(rank)
        sent[1].append(blob[start:])
    return [(mask_of(ranks), pickle.loads(memoryview(key)[_LENGTH.size:]),
             Rows(np.asarray(ranks), np.frombuffer(b"".join(rows), dtype=np.int64)
                  .reshape(len(ranks), -1)))
            for key, (ranks, rows) in senders.items()]


def ranks_of(mask: int) -> list[int]:
    """The ranks a rank set holds (bit r: rank r), ascending."""
    if not mask & (mask - 1):  # one rank (or none): without reading every bit
        return [mask.bit_length() - 1] if mask else []
    return [r for r, bit in enumerate(reversed(bin(mask)[2:])) if bit == "1"]


def mask_of(ranks: Iterable[int]) -> int:
    """The rank set of `ranks`."""
    mask = 0
    for r in ranks:
        mask |= 1 << r
    return mask


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
        # name -> each layout submitted for it -> the ranks that submitted it (a rank set)
        self.table: dict[str, dict[Meta, int]] = {}
        self._submitted: dict[str, int] = {}  # name -> the ranks that submitted it
        self.joined: list[int] = []
        self._sets: dict[int, tuple[list[int], int]] = {}  # set id -> (its ranks, their set)
        self._reported: dict[int, list[int]] = {}  # set id -> its ranks, as a report said
        # name -> the rows its allgather's ranks gave beside their reports, in arrival order
        self._rows: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    def forget(self, names: Iterable[str]) -> None:
        """Drops names completed without negotiation (response-cache hits); the
        negotiator calls it only while the table holds names (not in the steady state)."""
        for name in names:
            self.table.pop(name, None)
            self._submitted.pop(name, None)
            self._rows.pop(name, None)

    def process(self, reports: list[Report]) -> Decision:
        """One cycle over every rank's own report."""
        return self.process_grouped([(1 << rep.rank, rep) for rep in reports])

    def process_grouped(self, reports: list[tuple[int, Report]] |
                        list[tuple[int, Report, Rows]]) -> Decision:
        """One cycle over reports each sent by a set of ranks (a rank set, `ranks_of`),
        the set holding rank 0 first where there is one; a framed report comes with its
        ranks' rows (`group_reports`)."""
        joins: list[int] = []
        for _, rep, *_ in reports:
            for set_id, members in rep.sets.items():
                self._reported[set_id] = list(members)
        for mask, rep, *rows in reports:
            column = 0
            for name, meta in rep.requests:
                by_meta = self.table.setdefault(name, {})
                if self._submitted.get(name, 0) & mask:  # a rank gave its layout again
                    for other in [m for m in by_meta if m != meta]:
                        by_meta[other] &= ~mask
                        if not by_meta[other]:
                            del by_meta[other]
                by_meta[meta] = by_meta.get(meta, 0) | mask
                self._submitted[name] = self._submitted.get(name, 0) | mask
                if meta.kind == ALLGATHER and meta.shape and meta.shape[0] == OWN_ROWS:
                    self._rows.setdefault(name, []).append(
                        (rows[0].ranks, rows[0].values[:, column]))
                    column += 1
            if rep.join:
                joins.extend(ranks_of(mask))
        for rank in sorted(joins):
            if rank not in self.joined:
                self.joined.append(rank)
        joined = mask_of(self.joined)
        responses: list[Response] = []
        for name, by_meta in list(self.table.items()):
            response = self._try_complete(name, by_meta, self._submitted[name], joined)
            if response is not None:
                del self.table[name], self._submitted[name]
                self._rows.pop(name, None)
                responses.append(response)
        warnings = self._stalls(reports, responses, joined)
        knobs = next((rep.knobs for mask, rep, *_ in reports if mask & 1), None)
        return Decision(responses, warnings, knobs)

    def _members(self, set_id: int) -> tuple[list[int], int]:
        """A process set's ranks and their rank set (kept while the set's list is)."""
        try:
            members = self._members_of(set_id)
        except Exception:
            if set_id not in self._reported:
                raise
            members = self._reported[set_id]  # a set rank 0 has yet to register
        kept = self._sets.get(set_id)
        if kept is None or kept[0] is not members:
            kept = self._sets[set_id] = (members, mask_of(members))
        return kept

    def _try_complete(self, name: str, by_meta: dict[Meta, int], submitted: int,
                      joined_mask: int) -> Response | None:
        first = next(iter(by_meta))
        try:
            members, everyone = self._members(first.process_set_id)
        except Exception as exc:  # unknown process set: fail the tensor, not the engine
            return Response(name, first, error=str(exc))
        outsiders = submitted & ~everyone
        if outsiders:
            return Response(name, first, error=(
                f"tensor {name!r}: ranks {ranks_of(outsiders)} submitted it but are not in "
                f"process set {first.process_set_id} (members {members})"))
        joined = joined_mask & everyone & ~submitted
        if joined and first.kind != ALLREDUCE:
            return Response(name, first, error=(
                f"tensor {name!r}: ranks {ranks_of(joined)} have joined; only allreduce can "
                "run while ranks are joined"))
        if (submitted | joined) & everyone != everyone:
            return None
        return _agree(name, by_meta, members, self._rows.get(name, ()))

    def _stalls(self, reports: list, done: list[Response], joined: int) -> list[str]:
        warnings: list[str] = []
        finished = {r.name for r in done}
        ages: dict[str, float] = {}
        for _, rep, *_ in reports:
            for name, age in rep.stalled.items():
                if name not in finished:
                    ages[name] = max(age, ages.get(name, 0.0))
        for name, age in ages.items():
            by_meta = self.table.get(name, {})
            submitted = self._submitted.get(name, 0)
            first = next(iter(by_meta), None)
            members = self._members(first.process_set_id)[0] if first else []
            missing = [r for r in members if not (submitted | joined) >> r & 1]
            warnings.append(
                f"tensor {name!r} has waited {age:.0f}s: ranks {ranks_of(submitted)} submitted "
                f"it, ranks {missing} did not. One rank is skipping a collective or is stuck.")
            if self._stall_shutdown_s and age >= self._stall_shutdown_s and first is not None:
                del self.table[name], self._submitted[name]
                self._rows.pop(name, None)
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


def _rows_of(entries: list[tuple[int, Meta, int]], members: list[int],
             rows: Iterable[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Every rank's dim 0 of an allgather, indexed by rank: from the layouts that carry it
    and from the rows given beside the reports (later ones win)."""
    rows = list(rows)
    top = max([*members, *(int(ranks.max()) for ranks, _ in rows if len(ranks))])
    dims = np.zeros(top + 1, dtype=np.int64)
    for _, meta, mask in entries:
        if meta.shape[0] != OWN_ROWS:
            dims[ranks_of(mask)] = meta.shape[0]
    for ranks, values in rows:
        dims[ranks] = values
    return dims


def _agreed_part(meta: Meta) -> Meta:
    """The fields that must match: for allgather/alltoall dim 0 and splits may differ."""
    if meta.kind in (ALLGATHER, ALLTOALL):
        return Meta(meta.kind, meta.dtype, meta.shape[1:], meta.op, meta.root, meta.prescale,
                    meta.postscale, meta.process_set_id, meta.wire_dtype, meta.device,
                    framework=meta.framework)
    if meta.kind == BARRIER:
        return Meta(meta.kind, "", (), process_set_id=meta.process_set_id)
    return meta


def _agree(name: str, by_meta: dict[Meta, int], members: list[int],
           rows: Iterable[tuple[np.ndarray, np.ndarray]] = ()) -> Response:
    """The response to `name` that every member submitted (or joined without): an error
    naming who differs where layouts disagree. Layouts, not ranks, are iterated, except
    where the response carries a number per member (allgather's rows, alltoall's splits):
    rows given beside the reports (`rows`: ranks and their values, later ones win) are
    placed as arrays."""
    # each layout with its first rank, in rank order (hashing a layout costs: once each)
    entries = sorted(((mask & -mask, meta, mask) for meta, mask in by_meta.items()),
                     key=itemgetter(0))
    reference = entries[0][1]
    groups: dict[Meta, tuple[int, Meta]] = {}  # agreed part -> (its ranks, its first layout)
    for _, meta, mask in entries:
        part = _agreed_part(meta)
        ranks, shown = groups.get(part, (0, meta))
        groups[part] = (ranks | mask, shown)
    dims = _rows_of(entries, members, rows) if reference.kind == ALLGATHER else None

    def own(meta: Meta, ranks: int) -> Meta:  # an allgather's layout with its first rank's rows
        if dims is None or meta.shape[0] != OWN_ROWS:
            return meta
        first = (ranks & -ranks).bit_length() - 1
        return replace(meta, shape=(int(dims[first]), *meta.shape[1:]))

    if len(groups) > 1:
        parts = "; ".join(f"ranks {ranks_of(ranks)} have {_describe(own(shown, ranks))}"
                          for ranks, shown in groups.values())
        if len({m.framework for m in groups}) > 1:
            advice = ("Every rank of a job must send a collective from the same framework "
                      "(all raytrain_x.torch or all raytrain_x.tensorflow).")
        else:
            advice = ("Every rank must submit the same shape, dtype and op for a name "
                      "(allgather/alltoall: the same trailing dims).")
        return Response(name, reference,
                        error=f"ranks disagree on tensor {name!r}: {parts}. {advice}")
    if reference.kind not in (ALLGATHER, ALLTOALL):
        return Response(name, reference)
    if dims is not None:
        return Response(name, own(reference, entries[0][2]),
                        rank_dims=tuple(dims[members].tolist()))
    meta_of: dict[int, Meta] = {}
    for _, meta, mask in entries:
        meta_of.update(dict.fromkeys(ranks_of(mask), meta))
    splits = tuple(meta_of[r].splits for r in members)
    bad = [r for r, s in zip(members, splits) if len(s) != len(members)]
    if bad:
        return Response(name, reference, error=(
            f"alltoall {name!r}: ranks {bad} gave splits of the wrong length; give one "
            f"split per member ({len(members)})"))
    return Response(name, reference, rank_dims=splits)
