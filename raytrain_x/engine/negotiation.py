"""Negotiation: which pending requests every member has submitted, agreed the same way on
every rank.

Each cycle starts with one allreduce(BAND) of [status word, response-cache bits]: in steady
state this alone tells every rank which cached names are ready everywhere (in cache slot
order, identical on all ranks). Only when some rank has an uncached request, a stall, a
join or a knob change does rank 0 gather the reports, feed them to its `Coordinator` and
broadcast the decision (identical reports counted once: `coordinator.py`); a world of up
to `REPLICATED_UP_TO` ranks allgathers them and every rank decides alike. The status word
also carries each rank's answers about its arrays' layout (`plan.LayoutVotes`), and-ed like
the bits. Over a network, a small cached batch that repeats every step skips even the
status word: it travels with its readiness count in one allreduce (`Speculation`, below).
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from math import prod
from typing import Any

import numpy as np

from raytrain_x import _native
from raytrain_x.comm.groups import ProcessGroups, ProcessSetGroup
from raytrain_x.common.knobs import Knobs
from raytrain_x.engine.arrays import ops_for, ops_for_device
from raytrain_x.engine.buffers import pack, unpack
from raytrain_x.engine.coordinator import (
    Coordinator,
    Decision,
    Report,
    frame_report,
    group_reports,
)
from raytrain_x.engine.execution import (
    CollectiveRunner,
    is_floating,
    scale_integers,
    scales,
)
from raytrain_x.engine.messages import ALLREDUCE, DTYPE_SIZES, Meta, Request, Response
from raytrain_x.engine.plan import fusion_key

log = logging.getLogger("raytrain_x.engine")

# Status word bits, set when all is quiet so that a bitwise AND across ranks tells if any
# rank needs more than the cache fast path.
NOTHING_TO_REPORT = 1
NOT_SHUTTING_DOWN = 2
NO_MESSAGE = 4
JOINED = 8

# join states of this rank: none -> requested -> reported (joined)
JOIN_NONE, JOIN_REQUESTED, JOIN_REPORTED = "none", "requested", "reported"

# a world of up to this many ranks decides a negotiating cycle on every rank, from one
# allgather of the reports (two collectives); a larger one on rank 0, from a gather and a
# broadcast (four), so that no other rank's work grows with the world: the recovery of a
# small job negotiates every tensor of its state sync, and paid for the extra round trips
REPLICATED_UP_TO = 16

# agreed bit vectors whose responses are kept (a training loop repeats a handful a step)
_AGREED_KEPT = 64


@dataclass
class Agreement:
    """What every rank agreed on in one cycle.

    Attributes:
        responses: collectives to run now, in the same order on every rank.
        stop: every rank's engine stops after this cycle.
        all_joined: every rank has joined; the join completes.
        knobs: rank 0's knob switch, applied at the end of the cycle.
        joined_last: the rank that joined last (when `all_joined`).
        reports_exchanged: the ranks allgathered their reports (not only the status word).
        join_reported: this rank's join request went out in this cycle's report.
        cache_hits: responses agreed from the response cache's bits.
        stalls: stall warnings the reports raised (rank 0 logs them).
        knobs_sent: this rank's knob request went out in this cycle's report.
        plans: where the responses are exactly a set agreed before (the response cache
            unchanged since), a dict kept with that set for what is derived from it alone
            (`planner.plan_batches` keeps its plan there); else None.
        votes: the layout answers sent with the status word, and-ed over every rank.
        all_cached: every response is in the response cache (what `speculation` learns
            from).
    """

    responses: list[Response] = field(default_factory=list)
    stop: bool = False
    all_joined: bool = False
    knobs: Knobs | None = None
    joined_last: int = -1
    reports_exchanged: bool = False
    cache_hits: int = 0
    stalls: int = 0
    join_reported: bool = False
    knobs_sent: bool = False
    plans: dict | None = None
    votes: list[bool] = field(default_factory=list)
    all_cached: bool = False


class Negotiator:
    """The response cache, the status word and the coordinator of one engine.

    Args:
        groups: the round's groups (reports travel over the world group).
        world_allreduce: the world's fastest in-place allreduce (for the status vector).
        cache_capacity: response-cache entries (0 = off).
        stall_warning_s: report a request pending this long (as a stall).
        stall_shutdown_s: fail a name pending this long on some rank (0 = only warn).
    """

    def __init__(self, groups: ProcessGroups, world_allreduce: Callable[[Any, str], None],
                 cache_capacity: int, stall_warning_s: float, stall_shutdown_s: float) -> None:
        self.rank = groups.rdv.rank
        self._groups = groups
        self._world_allreduce = world_allreduce
        self._cache = _native.ResponseCache(cache_capacity)
        self._cache_version = 0  # bumped whenever entries may have changed
        # while the cache stays at `_agreed_version`: each cached name's response (parsed
        # once), and each agreed bit vector's responses and their plans
        self._responses: dict[str, Response | None] = {}
        self._agreed: dict[bytes, tuple[tuple[Response, ...], dict]] = {}
        self._agreed_version = -1
        self._outside: tuple[Any, list[str]] = (None, [])
        self._stall_warning_s = stall_warning_s
        self._next_stall_scan = 0.0
        self._coordinator = Coordinator(
            lambda set_id: groups.process_set(set_id).ranks, stall_shutdown_s)

    def set_cache_capacity(self, capacity: int) -> None:
        if capacity != self._cache.capacity:
            self._cache = _native.ResponseCache(capacity)
            self._cache_version += 1

    def touch(self, names: list[str]) -> None:
        """Marks cached `names` most recently used, in order (a speculative cycle ran them:
        the same touches as a cache hit, on every rank alike)."""
        for name in names:
            self._cache.get(name)

    def negotiate(self, pending: dict[str, Request], shutting_down: bool,
                  knobs_wanted: Knobs | None, join_state: str,
                  votes: Sequence[bool] = ()) -> Agreement:
        """One cycle's agreement over `pending` (this rank's requests not yet run); `votes`
        (the same number on every rank) travel with the status word, and-ed."""
        self._current()  # the cache changes only in the report exchange, after the bits
        stalled = self._stalled(pending)
        joined = join_state == JOIN_REPORTED
        cached: list[str] = []
        to_report = False  # a request no rank has been told about yet, and not cached
        for name, req in pending.items():
            if self._cache_matches(req):
                cached.append(name)
            elif not req.reported:
                to_report = True
        has_message = bool(stalled or knobs_wanted or join_state == JOIN_REQUESTED)

        status = NOT_SHUTTING_DOWN if not shutting_down else 0
        status |= NOTHING_TO_REPORT if not to_report else 0
        status |= NO_MESSAGE if not has_message else 0
        status |= JOINED if joined else 0
        words = self._cache.bits(self._cache.lru_order() if joined
                                 else cached + self._outside_names())
        end = 1 + len(words)
        ballot = _bit_words(votes)
        vector = np.empty(end + len(ballot), dtype=np.uint64)
        vector[0] = status
        vector[1:end] = words
        vector[end:] = ballot
        self._world_allreduce(vector.view(np.int64), "band")
        agreed = int(vector[0])
        result = Agreement(stop=not agreed & NOT_SHUTTING_DOWN,
                           all_joined=bool(agreed & JOINED),
                           votes=_flags(vector[end:], len(votes)))

        if not result.all_joined and len(words):
            responses, result.plans = self._agreed_for(vector[1:end])
            result.responses.extend(responses)
            result.cache_hits = len(responses)
            if self._coordinator.table:  # else nothing was ever reported for them
                self._coordinator.forget(r.name for r in responses)

        if not (agreed & NOTHING_TO_REPORT and agreed & NO_MESSAGE):
            self._exchange_reports(result, pending, stalled, knobs_wanted, join_state)
        result.all_cached = self._cache.capacity > 0 and (
            not result.reports_exchanged  # all from the cache's bits
            or all(self._cache.peek(r.name) is not None for r in result.responses))
        if result.all_joined:
            coordinator = self._coordinator
            result.joined_last = coordinator.joined[-1] if coordinator.joined else self.rank
            coordinator.joined = []
        return result

    def _current(self) -> None:
        """Forgets what was derived from the cache's entries if they may have changed."""
        if self._agreed_version != self._cache_version:
            self._responses.clear()
            self._agreed.clear()
            self._agreed_version = self._cache_version

    def _outside_names(self) -> list[str]:
        """Cached names of process sets this rank is not in. Their bits are set here, as
        agreement that asks nothing of this rank, so the AND across the world is the
        members' agreement alone (a set's cached collective otherwise waits for ranks that
        never submit it). Recomputed when the cache or the registered sets change."""
        key = (self._cache_version, self._groups.sets_version)
        if self._outside[0] != key:
            names = []
            sets = self._groups.sets
            for name in self._cache.lru_order():
                cached = self._response(name)
                set_id = cached.meta.process_set_id if cached is not None else 0
                if set_id and set_id in sets and not sets[set_id].included():
                    names.append(name)
            self._outside = (key, names)
        return self._outside[1]

    def _response(self, name: str) -> Response | None:
        """`name`'s cached response (its entry parsed once per cache version), or None."""
        if name not in self._responses:
            entry = self._cache.peek(name)
            self._responses[name] = (Response(name, Meta.from_cache(entry))
                                     if entry is not None else None)
        return self._responses[name]

    def _agreed_for(self, bits: np.ndarray) -> tuple[tuple[Response, ...], dict]:
        """The cached responses whose bits every rank set, in slot order, marked most
        recently used in that order (the same LRU touches on every rank). A bit vector met
        before (the steady state repeats a few a step) reuses its responses and plans until
        the cache changes; a new one takes each name's parsed response."""
        if len(self._agreed) >= _AGREED_KEPT:
            self._agreed.clear()
        words = bits.tolist()
        key = bits.tobytes()
        agreed = self._agreed.get(key)
        if agreed is None:
            agreed = self._agreed[key] = (tuple(
                self._response(n) for n in self._cache.names_for_bits(words)), {})
        self._cache.touch_bits(words)
        return agreed

    def _stalled(self, pending: dict[str, Request]) -> dict[str, float]:
        """Requests pending past the stall warning, each reported once per warning period;
        looked for a few times per period, not every cycle."""
        now = time.monotonic()
        if now < self._next_stall_scan:
            return {}
        self._next_stall_scan = now + min(1.0, self._stall_warning_s / 4)
        stalled = {}
        for name, req in pending.items():
            age = now - req.enqueued_at
            if age > self._stall_warning_s and now - req.stall_reported_at > self._stall_warning_s:
                stalled[name] = age
                req.stall_reported_at = now
        return stalled

    def _cache_matches(self, req: Request) -> bool:
        if req.meta.kind != ALLREDUCE or self._cache.capacity == 0:
            return False
        if req.cache_checked == self._cache_version:  # asked before, cache unchanged since
            return req.cache_hit
        cached = self._response(req.name)
        req.cache_hit = cached is not None and cached.meta == req.meta
        req.cache_checked = self._cache_version
        return req.cache_hit

    def _exchange_reports(self, result: Agreement, pending: dict[str, Request],
                          stalled: dict[str, float], knobs_wanted: Knobs | None,
                          join_state: str) -> None:
        result.reports_exchanged = True
        result.plans = None  # more responses than the agreed set's
        ready = {r.name for r in result.responses}
        # the rank is left out (-1): ranks that report the same send the same bytes
        report = Report(rank=-1, stalled=stalled,
                        knobs=knobs_wanted.to_dict() if knobs_wanted else None,
                        join=join_state == JOIN_REQUESTED)
        for name, req in pending.items():
            if not req.reported and name not in ready:
                report.requests.append((name, req.meta))
                req.reported = True
                set_id = req.meta.process_set_id
                if set_id and set_id not in report.sets and set_id in self._groups.sets:
                    report.sets[set_id] = tuple(self._groups.sets[set_id].ranks)
        world = self._groups.world
        if world.size <= REPLICATED_UP_TO:  # every rank decides alike: one exchange
            decision = self._decide(world.allgather_bytes(frame_report(report)))
        else:
            blobs = world.gather_bytes(frame_report(report), root=0)
            answer = None
            if blobs is not None:  # rank 0: coordinates
                answer = pickle.dumps((self._decide(blobs), self._coordinator.joined))
            decision, self._coordinator.joined = pickle.loads(world.broadcast_bytes(answer, 0))
        for r in decision.responses:
            if r.error:
                self._cache.erase(r.name)
            elif r.meta.kind == ALLREDUCE and self._cache.capacity:
                self._cache.put(r.name, r.meta.dtype, list(r.meta.shape), r.meta.cache_key())
        self._cache_version += 1
        result.responses.extend(decision.responses)
        result.stalls = len(decision.warnings)
        if self.rank == 0:
            for text in decision.warnings:
                log.warning(text)
        result.join_reported = report.join
        result.knobs_sent = knobs_wanted is not None
        result.knobs = Knobs(**decision.knobs) if decision.knobs else None

    def _decide(self, blobs: list[bytes]) -> Decision:
        """The coordinator's decision over every rank's framed report (rank order), each
        distinct report once with the ranks that sent it and their rows."""
        return self._coordinator.process_grouped(group_reports(blobs))


def _bit_words(flags: Sequence[bool]) -> np.ndarray:
    """`flags` as bits of 64-bit words (flag i: bit i % 64 of word i // 64)."""
    words = np.zeros((len(flags) + 63) // 64, dtype=np.uint64)
    for i, flag in enumerate(flags):
        if flag:
            words[i // 64] |= np.uint64(1 << (i % 64))
    return words


def _flags(words: np.ndarray, count: int) -> list[bool]:
    """The first `count` flags of `_bit_words`' words."""
    return [bool(int(words[i // 64]) >> (i % 64) & 1) for i in range(count)]


# ------------------------------------------------------------ speculative cycles
# Speculative cycles: one round trip for a small allreduce that repeats every step.
#
# Over a network every negotiating cycle costs a round trip (the status-word allreduce)
# before the data's own allreduce, so a small cached allreduce pays two. A training loop,
# though, sends the same small batches every step, in the same order. Once every rank has
# seen the same cached batch follow the one before it twice in a row, each rank expects it
# again, and the next cycle sends one allreduce(sum) of [readiness, the batch's data]: a
# rank adds 1 when its pending requests are exactly that batch (same names, same
# descriptions) and it has nothing else to say (no shutdown, join or knob change), else 0
# and zeros. A count equal to the world size means every rank contributed the real data:
# the sums are the result and the step took one round trip. Any other count discards the
# sums (the inputs were copied, not reduced in place), the expectation is dropped on every
# rank alike, and the cycle goes on with ordinary negotiation. The decision is a function
# of agreed history only, so every rank makes the same one.
#
# Everything of it is below: what every rank expects (`Speculator`, from the batches that
# negotiation agreed), whether this rank is ready, the exchange of readiness and data, and
# its verdict (`Speculation`). The engine asks it first in a cycle where a batch is expected,
# and completes the batch's handles when it succeeded; execution lends it a fusion buffer
# and a flat sum over the network.

MAX_BYTES = 64 << 10  # beyond this the saved round trip is noise next to the data
# dtypes whose sum of 0/1 counts stays exact for any world this engine runs
COUNT_DTYPES = frozenset({"float32", "float64", "int32", "int64"})


def speculable(batch: list[Response]) -> bool:
    """Whether a negotiated batch may be sent speculatively next time: allreduces of the
    global set, fusable together, in a dtype that holds the readiness count exactly, summed
    (or averaged), in host memory, small."""
    if not batch:
        return False
    key = fusion_key(batch[0])
    meta = batch[0].meta
    return (all(not r.error and r.meta.kind == ALLREDUCE and fusion_key(r) == key
                for r in batch)
            and meta.process_set_id == 0 and meta.device == "cpu"
            and meta.op in ("sum", "average") and meta.dtype in COUNT_DTYPES
            and meta.wire_dtype in ("", meta.dtype)
            and sum(r.meta.nbytes_on_wire() for r in batch) <= MAX_BYTES)


def elements(batch: list[Response]) -> list[int]:
    return [prod(r.meta.shape) for r in batch]


class Speculator:
    """What every rank expects the next cycle to run (identical on all ranks).

    It learns which batch followed which (a loop of one batch, or of several small
    allreduces in turn: loss, then accuracy) from the batches every rank ran, and expects a
    successor once it followed the same batch twice in a row.
    """

    MAX_TRANSITIONS = 64

    def __init__(self) -> None:
        self._prev: tuple | None = None  # the last batch run (None: not speculable)
        # batch -> (the batch that followed it, how many times in a row)
        self._next: dict[tuple, tuple[list[Response], int]] = {}
        self.expected: list[Response] | None = None
        self.hits = 0
        self.misses = 0

    def observe(self, responses: list[Response], cached: bool) -> None:
        """After a negotiated cycle that ran `responses` (all in the response cache when
        `cached`)."""
        if responses:
            self._advance(responses if cached and speculable(responses) else None)

    def ready(self, pending: dict[str, Request]) -> bool:
        """Whether this rank's pending requests are exactly the expected batch."""
        expected = self.expected
        if expected is None or len(pending) != len(expected):
            return False
        for r in expected:
            req = pending.get(r.name)
            if req is None or req.meta != r.meta:
                return False
        return True

    def succeeded(self) -> None:
        self.hits += 1
        self._advance(self.expected)

    def failed(self) -> None:
        """Forgets the transition that was expected (every rank sees the same count, so
        all forget it); the negotiated batch that runs instead follows the same one."""
        self.misses += 1
        self._next.pop(self._prev, None)
        self.expected = None

    def reset(self) -> None:
        """Knobs changed: expect nothing until batches repeat under the new ones."""
        self._prev = None
        self._next.clear()
        self.expected = None

    def _advance(self, batch: list[Response] | None) -> None:
        key = _key(batch) if batch is not None else None
        if self._prev is not None and key is not None:
            follower = self._next.get(self._prev)
            times = follower[1] + 1 if follower and _key(follower[0]) == key else 1
            if len(self._next) >= self.MAX_TRANSITIONS and self._prev not in self._next:
                self._next.clear()
            self._next[self._prev] = (batch, times)
        self._prev = key
        follower = self._next.get(key) if key is not None else None
        self.expected = follower[0] if follower is not None and follower[1] >= 2 else None


def _key(batch: list[Response]) -> tuple:
    return tuple((r.name, r.meta) for r in batch)


class Speculation:
    """The speculative cycles of one engine (where the world meets over a network: shared
    memory answers the status word in microseconds).

    Args:
        enabled: speculate at all (a world of several ranks without shared memory).
        runner: the engine's execution (a fusion buffer and a flat sum).
    """

    def __init__(self, enabled: bool, runner: CollectiveRunner) -> None:
        self.enabled = enabled
        self.learned = Speculator()
        self._runner = runner

    def expected(self) -> list[Response] | None:
        """The batch every rank sends speculatively this cycle, or None (same on all)."""
        return self.learned.expected if self.enabled else None

    def observe(self, responses: list[Response], cached: bool) -> None:
        """After a negotiated cycle that ran `responses` (all in the response cache when
        `cached`)."""
        if self.enabled:
            self.learned.observe(responses, cached)

    def reset(self) -> None:
        """Knobs changed: expect nothing until batches repeat under the new ones."""
        self.learned.reset()

    def cycle(self, pending: dict[str, Request], quiet: bool, pset: ProcessSetGroup,
              knobs: Knobs) -> tuple[list[Request], list[Any]] | None:
        """Sends the expected batch with this rank's readiness: ready when `pending` is
        exactly that batch and the rank is `quiet` (no shutdown, join or knob change to
        report). Returns the batch's requests and results when every member was ready;
        None when some was not (the inputs are untouched, the expectation dropped)."""
        expected = self.learned.expected
        ready = quiet and self.learned.ready(pending)
        requests = [pending[r.name] for r in expected] if ready else []
        results = self._exchange(expected, requests, pset, knobs)
        if results is None:
            self.learned.failed()
            return None
        self.learned.succeeded()
        return requests, results

    def _exchange(self, batch: list[Response], requests: list[Request],
                  pset: ProcessSetGroup, knobs: Knobs) -> list[Any] | None:
        """One allreduce(sum) of [readiness, the batch fused]. `requests` is the batch's
        requests on a ready rank, empty on one that is not (it sends zeros). Returns the
        results when every member was ready, else None."""
        meta = batch[0].meta
        counts = elements(batch)
        buf = self._runner.fusion_buffer(meta.dtype,
                                         (sum(counts) + 1) * DTYPE_SIZES[meta.dtype])
        flat = ops_for_device("cpu").view_buffer(buf, sum(counts) + 1)
        ready = bool(requests)
        floating = is_floating(meta.dtype)
        pre, post = scales(meta, pset.size())
        int_pre, int_post = (1.0, 1.0) if floating else (pre, post)
        if not floating:
            pre = post = 1
        names = [r.name for r in batch]
        if ready:
            tensors = [req.tensor for req in requests]
            packed = tensors
            if int_pre != 1.0:  # scaled copies: the inputs stay untouched until all are ready
                packed = [ops_for(t).clone(t) for t in tensors]
                scale_integers(packed, int_pre)
            pack(packed, buf, pre, 1, names)
        else:
            flat[1:] = 0
        flat[0] = 1 if ready else 0
        row = batch[0].name if len(batch) == 1 else f"fused[{len(batch)}]"
        self._runner.sum_flat(flat, meta.dtype, row, pset, knobs)
        if int(flat[0]) != pset.size() or not ready:
            return None
        unpack(buf, tensors, post, 1, names)
        scale_integers(tensors, int_post)
        return [req.output if req.output is not None else req.tensor for req in requests]
