"""Pure logic of negotiation, planning, failure reports and elastic rounds (no processes)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from raytrain_x.common.errors import ConfigError, InternalError, WorkerError
from raytrain_x.engine.arrays import NUMPY, ops_for
from raytrain_x.engine.coordinator import Coordinator, Report, frame_report, group_reports
from raytrain_x.engine.messages import ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, Meta, Response
from raytrain_x.engine.plan import (
    IN_FLIGHT_MIN_BYTES,
    IN_FLIGHT_PIECE_BYTES,
    in_flight_pieces,
    plan_batches,
)
from raytrain_x.engine.transport import IN_FLIGHT_DEPTH, IN_FLIGHT_HELD, PieceStream
from raytrain_x.ray.elastic.rounds import plan_round
from raytrain_x.ray.failures import root_cause


def _coordinator(sets=None, stall_shutdown_s=0.0):
    sets = sets or {0: [0, 1, 2]}

    def members_of(set_id):
        if set_id not in sets:
            raise ConfigError(f"no process set with id {set_id}")
        return sets[set_id]

    return Coordinator(members_of, stall_shutdown_s)


def _allreduce(shape=(4,), dtype="float32", op="sum", set_id=0):
    return Meta(ALLREDUCE, dtype, shape, op, process_set_id=set_id)


# ----------------------------------------------------------------- coordinator
def test_a_name_completes_once_every_member_reported_it_across_cycles():
    c = _coordinator()
    first = c.process([Report(0, [("g", _allreduce())]), Report(1, [("g", _allreduce())]),
                       Report(2)])
    assert first.responses == [] and "g" in c.table
    second = c.process([Report(0), Report(1), Report(2, [("g", _allreduce())])])
    assert [r.name for r in second.responses] == ["g"] and not second.responses[0].error
    assert "g" not in c.table


def test_disagreeing_ranks_get_an_error_that_names_both_sides():
    c = _coordinator({0: [0, 1]})
    out = c.process([Report(0, [("g", _allreduce((4,)))]), Report(1, [("g", _allreduce((5,)))])])
    (resp,) = out.responses
    assert "ranks disagree on tensor 'g'" in resp.error
    assert "ranks [0] have allreduce float32[4]" in resp.error
    assert "ranks [1] have allreduce float32[5]" in resp.error


def test_allgather_may_differ_in_dim0_and_reports_every_rank_s_rows():
    c = _coordinator({0: [0, 1]})
    meta = lambda n: Meta(ALLGATHER, "float32", (n, 3))  # noqa: E731
    (resp,) = c.process([Report(0, [("a", meta(2))]), Report(1, [("a", meta(5))])]).responses
    assert not resp.error and resp.rank_dims == (2, 5)


def test_alltoall_splits_of_the_wrong_length_are_an_error():
    c = _coordinator({0: [0, 1]})
    good = Meta(ALLTOALL, "float32", (2,), splits=(1, 1))
    bad = Meta(ALLTOALL, "float32", (2,), splits=(2,))
    (resp,) = c.process([Report(0, [("t", good)]), Report(1, [("t", bad)])]).responses
    assert "ranks [1] gave splits of the wrong length" in resp.error


def test_outsiders_and_unknown_process_sets_fail_the_tensor_not_the_engine():
    c = _coordinator({0: [0, 1, 2], 1: [0, 1]})
    out = c.process([Report(2, [("p", _allreduce(set_id=1))]),
                     Report(0, [("q", _allreduce(set_id=7))])])
    errors = {r.name: r.error for r in out.responses}
    assert "ranks [2] submitted it but are not in process set 1" in errors["p"]
    assert "no process set with id 7" in errors["q"]


def test_joined_ranks_count_as_present_for_allreduce_only():
    c = _coordinator({0: [0, 1]})
    c.process([Report(1, join=True)])
    assert c.joined == [1]
    out = c.process([Report(0, [("g", _allreduce()), ("b", Meta(BROADCAST, "float32", (1,)))])])
    errors = {r.name: r.error for r in out.responses}
    assert errors["g"] == ""
    assert "only allreduce can run while ranks are joined" in errors["b"]


def test_stalls_warn_with_the_missing_ranks_and_fail_after_the_shutdown_time():
    c = _coordinator({0: [0, 1]}, stall_shutdown_s=30.0)
    c.process([Report(0, [("g", _allreduce())])])
    warned = c.process([Report(0, stalled={"g": 10.0}), Report(1)])
    assert warned.responses == [] and "ranks [1] did not" in warned.warnings[0]
    failed = c.process([Report(0, stalled={"g": 31.0}), Report(1)])
    assert "stalled for 31s" in failed.responses[0].error


def test_only_rank_0_s_knobs_are_taken():
    c = _coordinator({0: [0, 1]})
    assert c.process([Report(0, knobs={"a": 1}), Report(1, knobs={"a": 2})]).knobs == {"a": 1}
    assert c.process([Report(0), Report(1, knobs={"a": 2})]).knobs is None


# ----------------------------------------------------------------- planner
def _response(name, nbytes, dtype="float32", fuse=True, kind=ALLREDUCE, op="sum"):
    return Response(name, Meta(kind, dtype, (nbytes // 4,), op, fuse=fuse))


def test_allreduces_fuse_up_to_the_threshold_in_response_order():
    rs = [_response(f"g{i}", 400) for i in range(5)]
    assert [[r.name for r in b] for b in plan_batches(rs, 1000)] == [
        ["g0", "g1"], ["g2", "g3"], ["g4"]]


def test_threshold_zero_and_buckets_run_alone():
    rs = [_response("a", 40), _response("b", 40, fuse=False), _response("c", 40)]
    assert [len(b) for b in plan_batches(rs, 0)] == [1, 1, 1]
    assert [[r.name for r in b] for b in plan_batches(rs, 1000)] == [["a", "c"], ["b"]]


def test_different_keys_never_share_a_batch_and_non_allreduce_runs_alone():
    rs = [_response("f", 40), _response("d", 40, dtype="float64"), _response("f2", 40),
          _response("ag", 40, kind=ALLGATHER, op="")]
    batches = [[r.name for r in b] for b in plan_batches(rs, 1 << 20)]
    assert batches == [["f", "f2"], ["d"], ["ag"]]


def test_errors_are_planned_alone():
    bad = Response("x", _allreduce(), error="mismatch")
    assert plan_batches([_response("a", 40), bad, _response("b", 40)], 1 << 20) == [
        [_response("a", 40), _response("b", 40)], [bad]]


# ----------------------------------------------------------------- arrays
def test_numpy_ops_describe_allocate_and_view_a_fusion_buffer():
    from raytrain_x.engine.buffers import FusionBufferPool

    a = np.arange(6, dtype=np.float16).reshape(2, 3)
    assert ops_for(a) is NUMPY
    assert (NUMPY.dtype(a), NUMPY.device(a), NUMPY.numel(a)) == ("float16", "cpu", 6)
    assert NUMPY.is_floating(a) and not NUMPY.is_floating(a.astype(np.int32))
    assert not NUMPY.is_contiguous(a.T)
    buf = FusionBufferPool().get("float32", 16)
    view = NUMPY.view_buffer(buf, 4)
    view[:] = [1, 2, 3, 4]
    assert NUMPY.view_buffer(buf, 4).tolist() == [1, 2, 3, 4]  # same memory
    # torch's quint4x2 (bfloat16 has one once ml_dtypes is loaded, as TensorFlow loads it)
    with pytest.raises(ConfigError, match="no numpy equivalent"):
        NUMPY.zeros((2,), "quint4x2")
    with pytest.raises(ConfigError, match="cannot send a list"):
        ops_for([1, 2])


# ----------------------------------------------------------------- failures
def test_the_root_cause_is_the_lowest_rank_that_did_not_only_lose_a_peer():
    errors = {0: WorkerError(0, "InternalError: peer gone", lost_peer=True),
              1: WorkerError(1, "ValueError: bad batch"),
              2: WorkerError(2, "KeyError: x")}
    chosen = root_cause(errors)
    assert chosen.rank == 1 and "ValueError" in chosen.detail
    assert "(ranks [0, 2] stopped because of this failure)" in chosen.detail


def test_the_root_cause_falls_back_to_the_lowest_rank_and_ignores_message_text():
    # a user error whose text mentions InternalError is still a cause: types decide
    errors = {3: WorkerError(3, "lost", lost_peer=True),
              1: WorkerError(1, "RuntimeError: InternalError in my own code")}
    assert root_cause(errors).rank == 1
    assert root_cause({2: WorkerError(2, "a", True), 4: WorkerError(4, "b", True)}).rank == 2


# ----------------------------------------------------------------- elastic rounds
def test_the_oldest_worker_becomes_rank_0_and_hosts_get_consecutive_ranks():
    members = {"w5": ("nodeB", 5), "w1": ("nodeA", 1), "w3": ("nodeB", 3), "w4": ("nodeA", 4)}
    places = plan_round(members, round_id=7, hosts_version=2)
    ranks = {w: p["rank"] for w, p in places.items()}
    assert ranks == {"w1": 0, "w4": 1, "w3": 2, "w5": 3}
    assert places["w3"]["cross_rank"] == 1 and places["w3"]["local_rank"] == 0
    assert {p["size"] for p in places.values()} == {4}
    assert {p["round"] for p in places.values()} == {7}
    by_rank = sorted(places, key=lambda w: places[w]["rank"])
    assert [members[w][0] for w in by_rank] == ["nodeA", "nodeA", "nodeB", "nodeB"]
    assert "hosts" not in places["w1"]  # a place is O(1) in the round's size
    assert places["w1"]["hosts_version"] == 2


def test_a_round_of_survivors_keeps_the_oldest_as_rank_0():
    places = plan_round({"w9": ("n2", 9), "w2": ("n1", 2)}, 3, 0)
    assert places["w2"]["rank"] == 0 and places["w9"]["rank"] == 1
    assert places["w9"]["cross_size"] == 2 and places["w9"]["local_size"] == 1


# ----------------------------------------------------------------- speculation
def _resp(name, dtype="float32", shape=(10,), op="sum", **meta):
    return Response(name, Meta(ALLREDUCE, dtype, shape, op, **meta))


def _pending(*responses):
    from raytrain_x.engine.messages import Handle, Request

    return {r.name: Request(r.name, r.meta, None, Handle(r.name)) for r in responses}


def test_speculable_batches_are_small_summed_host_allreduces_of_the_global_set():
    from raytrain_x.engine.negotiation import MAX_BYTES, speculable

    assert speculable([_resp("a"), _resp("b", shape=(3, 4))])
    assert speculable([_resp("a", op="average", dtype="int64")])
    assert not speculable([])
    assert not speculable([_resp("a", op="max")])  # the count needs a sum
    assert not speculable([_resp("a", dtype="bfloat16")])  # cannot count exactly
    assert not speculable([_resp("a", process_set_id=1)])
    assert not speculable([_resp("a", device="cuda:0")])
    assert not speculable([_resp("a", wire_dtype="float16")])
    assert not speculable([_resp("a"), _resp("b", dtype="float64")])  # not one fusion
    assert not speculable([_resp("a", shape=(MAX_BYTES // 4 + 1,))])
    assert not speculable([Response("b", Meta(BROADCAST, "float32", (4,)))])


def test_speculator_expects_a_batch_that_followed_the_same_one_twice():
    from raytrain_x.engine.negotiation import Speculator

    s = Speculator()
    g = [_resp("g")]
    s.observe(g, cached=True)
    s.observe(g, cached=True)
    assert s.expected is None  # g followed g once
    s.observe(g, cached=True)
    assert s.expected == g
    assert s.ready(_pending(*g))
    assert not s.ready({})
    assert not s.ready(_pending(*g, _resp("x")))  # more pending than expected
    assert not s.ready(_pending(_resp("g", shape=(11,))))  # same name, other shape
    s.succeeded()
    assert s.expected == g and s.hits == 1
    s.failed()
    assert s.expected is None and s.misses == 1
    s.observe(g, cached=True)  # g -> g seen once again after the miss
    assert s.expected is None
    s.observe(g, cached=True)
    assert s.expected == g


def test_speculator_learns_a_cycle_of_batches_and_forgets_on_reset():
    from raytrain_x.engine.negotiation import Speculator

    s = Speculator()
    loss, acc = [_resp("loss")], [_resp("acc", dtype="int64", op="average")]
    for _ in range(2):
        s.observe(loss, cached=True)
        s.observe(acc, cached=True)
    s.observe(loss, cached=True)
    assert s.expected == acc
    s.succeeded()
    assert s.expected == loss
    s.reset()
    assert s.expected is None
    s.observe(acc, cached=True)
    assert s.expected is None


def test_speculator_ignores_uncached_and_unfit_batches():
    from raytrain_x.engine.negotiation import Speculator

    s = Speculator()
    for _ in range(3):
        s.observe([_resp("g")], cached=False)
    assert s.expected is None
    big = [_resp("bucket", shape=(1 << 20,))]
    for _ in range(3):
        s.observe(big, cached=True)
    assert s.expected is None
    s.observe([], cached=True)  # an idle cycle changes nothing
    assert s.expected is None


@pytest.mark.parametrize("total, parts, chunk", [(0, 2, 8), (12, 2, 4), (14, 2, 5), (9, 3, 1),
                                                 (3_000_002, 2, 1 << 20)])
def test_hierarchical_chunks_cover_the_array_in_multiples_of_the_local_size(total, parts,
                                                                             chunk):
    from raytrain_x.engine.transport import _chunks

    ranges = _chunks(total, parts, chunk)
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, in order
    assert all((hi - lo) % parts == 0 for lo, hi in ranges)  # every part gets a shard
    assert all(hi - lo <= max(parts, chunk) for lo, hi in ranges)


def test_a_batch_crosses_a_network_in_pieces_cut_from_its_sizes():
    M = IN_FLIGHT_MIN_BYTES
    # the small arrays together first, then each large one alone, in batch order
    assert in_flight_pieces([10, 3 * M, 20, M, M - 1]) == [[0, 2, 4], [1], [3]]
    assert in_flight_pieces([M, 2 * M]) == [[0], [1]]
    assert in_flight_pieces([5, 6]) == [[0, 1]]
    assert in_flight_pieces([]) == []


def test_arrays_back_to_back_on_every_rank_cross_together_a_piece_at_a_time():
    M, P = IN_FLIGHT_MIN_BYTES, IN_FLIGHT_PIECE_BYTES
    Q = P // 4
    # one buffer's views: cut at the piece size, a larger array alone
    assert in_flight_pieces([Q, Q, Q, Q, Q], [False, True, True, True, True]) == [
        [0, 1, 2, 3], [4]]
    assert in_flight_pieces([10, 2 * P, 10, 20], [False, True, True, True]) == [
        [0, 2, 3], [1]]
    # small arrays back to back with a large one ride in its piece
    assert in_flight_pieces([10, M, 20], [False, True, True]) == [[0, 1, 2]]
    # a run too small for a piece of its own joins the packed small arrays
    assert in_flight_pieces([10, 20, 2 * M, 30], [False, True, False, False]) == [
        [0, 1, 3], [2]]
    # nothing joined: as cut from the sizes alone
    assert in_flight_pieces([10, 3 * M, 20], [False] * 3) == in_flight_pieces([10, 3 * M, 20])


class _Wire:
    """A group whose transfers land when the test says (`land`; those named in `landed`
    or `failed` land as they are sent); waiting for one that has not landed is a test
    bug."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.landed: set[str] = set()
        self.failed: set[str] = set()
        self._callbacks: dict[str, object] = {}

    def allreduce_async(self, array: str, op: str, landed=None, prescale=1.0, postscale=1.0):
        self.sent.append(array)
        self._callbacks[array] = landed
        if array in self.landed | self.failed:
            self.land(array)

        def finish() -> None:
            if array in self.failed:
                raise InternalError(f"{array} failed")
            assert array in self.landed, f"waited for {array} before it landed"
        return finish

    def land(self, array: str) -> None:
        if array not in self.failed:
            self.landed.add(array)
        self._callbacks.pop(array)()


def test_pieces_stream_across_batches_and_each_batch_completes_after_its_last_piece():
    wire, log = _Wire(), []
    stream = PieceStream()
    wire.landed.update(f"p{i}" for i in range(IN_FLIGHT_DEPTH + 2))
    for i in range(IN_FLIGHT_DEPTH + 2):  # batch a: all but the last two; batch b: those
        stream.send(wire, f"p{i}", "sum", lambda i=i: log.append(f"after p{i}"))
        stream.make_room()
        if i == IN_FLIGHT_DEPTH - 1:
            stream.close_batch(lambda err: log.append(f"a done {err}"))
    stream.close_batch(lambda err: log.append(f"b done {err}"))
    # the oldest pieces were finished as later ones went out; batch b's are still crossing
    assert len(wire.sent) == IN_FLIGHT_DEPTH + 2 and 0 < len(stream) <= IN_FLIGHT_DEPTH
    assert "b done None" not in log
    stream.drain()
    afters = [e for e in log if e.startswith("after")]
    assert afters == [f"after p{i}" for i in range(IN_FLIGHT_DEPTH + 2)]  # in order
    assert log.index("a done None") == log.index(f"after p{IN_FLIGHT_DEPTH - 1}") + 1
    assert log[-1] == "b done None" and len(stream) == 0
    # nothing crossing: a batch completes as it closes
    stream.close_batch(lambda err: log.append(f"c done {err}"))
    assert log[-1] == "c done None"


def test_a_piece_goes_out_as_soon_as_any_lands_and_pieces_finish_in_order():
    wire, log = _Wire(), []
    stream = PieceStream()
    for i in range(IN_FLIGHT_DEPTH):
        stream.send(wire, f"p{i}", "sum", lambda i=i: log.append(f"after p{i}"))
    wire.land(f"p{IN_FLIGHT_DEPTH - 1}")  # the newest lands first: room for one more
    stream.make_room()
    stream.send(wire, "next", "sum", lambda: log.append("after next"))
    stream.close_batch(lambda err: log.append(f"done {err}"))
    assert log == []  # p0 still crosses: nothing behind it is finished before it
    assert len(stream) == IN_FLIGHT_DEPTH + 1
    wire.land("p0")
    wire.land("next")
    stream.drain()
    assert log == [f"after p{i}" for i in range(IN_FLIGHT_DEPTH)] + ["after next", "done None"]
    # however fast the later ones land, at most IN_FLIGHT_HELD wait behind the oldest: the
    # next waits until it lands
    order = []

    def land_slow_once_the_stream_is_full() -> None:
        while len(stream) < IN_FLIGHT_HELD:
            time.sleep(0.01)
        order.append("slow landed")
        wire.land("slow")

    stream.send(wire, "slow", "sum", lambda: None)
    lander = threading.Thread(target=land_slow_once_the_stream_is_full)
    lander.start()
    for i in range(IN_FLIGHT_HELD):
        wire.landed.add(f"q{i}")
        stream.make_room()
        order.append(f"q{i} sent")
        stream.send(wire, f"q{i}", "sum", lambda: None)
        assert len(stream) <= IN_FLIGHT_HELD
    lander.join()
    assert order.index("slow landed") == order.index(f"q{IN_FLIGHT_HELD - 1} sent") - 1
    stream.drain()


def test_an_idle_engine_finishes_pieces_as_they_land():
    # `finish_landed` never waits, and still finishes nothing behind the oldest first;
    # `wait_for_work` sleeps until work comes, finishing pieces as they land (a landing
    # wakes it: here the batch completes long before the wait's own end)
    wire, log = _Wire(), []
    stream = PieceStream()
    stream.wakes = threading.Condition()
    stream.send(wire, "p0", "sum", lambda: log.append("after p0"))
    stream.send(wire, "p1", "sum", lambda: log.append("after p1"))
    stream.close_batch(lambda err: log.append(f"done {err}"))
    wire.land("p1")
    stream.finish_landed()
    assert log == [] and len(stream) == 2
    lander = threading.Thread(target=lambda: wire.land("p0"))
    began = time.monotonic()
    lander.start()
    stream.wait_for_work(lambda: bool(log), 60.0)
    lander.join()
    assert log == ["after p0", "after p1", "done None"] and len(stream) == 0
    assert time.monotonic() - began < 30.0
    # nothing crossing and no work: it returns when its time is up
    stream.wait_for_work(lambda: False, 0.01)


def test_a_failed_piece_fails_every_batch_still_crossing():
    wire, log = _Wire(), []
    stream = PieceStream()
    wire.failed.add("p0")
    stream.send(wire, "p0", "sum", lambda: log.append("after p0"))
    stream.close_batch(lambda err: log.append(f"a {err}"))
    with pytest.raises(InternalError):  # p0's failure surfaces as the next piece goes out
        stream.send(wire, "p1", "sum", lambda: log.append("after p1"))
    stream.close_batch(lambda err: log.append(f"b {err}"))
    with pytest.raises(InternalError):
        stream.drain()
    stream.fail(InternalError("p0 failed"))
    assert log == ["a p0 failed", "b p0 failed"] and len(stream) == 0


class _OneRank:
    """The groups of a world of one rank, for the negotiation's pure logic: every
    collective of one rank gives back its own input."""

    class rdv:  # noqa: N801 - stands in for the Rendezvous attribute
        rank, size = 0, 1

    class world:  # noqa: N801 - stands in for the world group
        size = 1

        @staticmethod
        def allgather_bytes(blob: bytes) -> list[bytes]:
            return [blob]

        @staticmethod
        def gather_bytes(blob: bytes, root: int = 0) -> list[bytes]:
            return [blob]

        @staticmethod
        def broadcast_bytes(blob: bytes, root: int = 0) -> bytes:
            return blob

    @staticmethod
    def process_set(set_id: int):
        class _Set:
            ranks = [0]
        return _Set

    sets_version = 0  # the registered sets never change: the global one alone
    sets: dict = {}


def test_reports_sent_by_many_ranks_at_once_decide_as_each_ranks_own_would():
    """Rank 0 coordinates and counts identical reports once (a rank set each): the
    decisions, errors and per-member numbers are those of every rank's own report."""
    from raytrain_x.engine.coordinator import mask_of, ranks_of

    size = 70  # past 64: rank sets span more than one machine word
    everyone = list(range(size))
    odd = [r for r in everyone if r % 2]
    even = [r for r in everyone if not r % 2]
    wide = Meta(ALLREDUCE, "float32", (8,), "sum")
    requests_even = [("g", _allreduce()), ("bad", _allreduce()),
                     ("rows", Meta(ALLGATHER, "float32", (2, 3)))]
    requests_odd = [("g", _allreduce()), ("bad", wide),
                    ("rows", Meta(ALLGATHER, "float32", (5, 3)))]

    def by_each_rank():
        reports = [Report(r, requests_even if r % 2 == 0 else requests_odd) for r in everyone]
        return _coordinator({0: everyone}).process(reports)

    def grouped():
        return _coordinator({0: everyone}).process_grouped(
            [(mask_of(even), Report(-1, requests_even)), (mask_of(odd), Report(-1, requests_odd))])

    for decision in (by_each_rank(), grouped()):
        out = {r.name: r for r in decision.responses}
        assert not out["g"].error
        assert f"ranks {even} have allreduce float32[4]" in out["bad"].error
        assert f"ranks {odd} have allreduce float32[8]" in out["bad"].error
        assert out["rows"].rank_dims == tuple(2 if r % 2 == 0 else 5 for r in everyone)
    # a name half the ranks sent waits for the rest; joined ranks complete an allreduce
    c = _coordinator({0: everyone})
    assert not c.process_grouped([(mask_of(even), Report(-1, [("h", _allreduce())]))]).responses
    (done,) = c.process_grouped([(mask_of(odd), Report(-1, join=True))]).responses
    assert done.name == "h" and not done.error and c.joined == odd
    assert ranks_of(mask_of([0, 3, 69])) == [0, 3, 69]


def test_ranks_that_differ_only_in_their_allgather_rows_send_one_report():
    """Each rank's rows travel beside its report: 64 ranks with rows of their own are one
    distinct report (the coordinator's work does not grow with N), and the response still
    carries every rank's rows, the layout rank 0 gave, and disagreements as before."""
    everyone = list(range(64))

    def report(rank):
        return Report(-1, [("g", _allreduce()), ("rows", Meta(ALLGATHER, "float32", (rank, 3))),
                           ("more", Meta(ALLGATHER, "int64", (2 * rank + 1,)))])

    grouped = group_reports([frame_report(report(r)) for r in everyone])
    assert len(grouped) == 1 and grouped[0][0] == (1 << 64) - 1
    out = {r.name: r for r in _coordinator({0: everyone}).process_grouped(grouped).responses}
    assert not any(r.error for r in out.values())
    assert out["rows"].rank_dims == tuple(everyone)
    assert out["more"].rank_dims == tuple(2 * r + 1 for r in everyone)
    assert out["rows"].meta == Meta(ALLGATHER, "float32", (0, 3))  # rank 0's own
    # the same as reports with the rows inside, one per rank
    inside = _coordinator({0: everyone}).process([
        Report(r, report(r).requests) for r in everyone]).responses
    assert {r.name: r for r in inside} == out
    # trailing dims that differ are still named; rows given over two cycles still add up
    bad = [Report(-1, [("t", Meta(ALLGATHER, "float32", (r, 3 + (r == 5))))]) for r in range(8)]
    (resp,) = _coordinator({0: list(range(8))}).process_grouped(
        group_reports([frame_report(b) for b in bad])).responses
    assert "ranks [5] have allgather float32[5, 4]" in resp.error
    c = _coordinator({0: [0, 1, 2]})
    first = group_reports([frame_report(Report(-1, [("x", Meta(ALLGATHER, "float32", (4,)))])),
                           frame_report(Report(-1)), frame_report(Report(-1))])
    assert not c.process_grouped(first).responses
    later = group_reports([frame_report(Report(-1)),
                           *[frame_report(Report(-1, [("x", Meta(ALLGATHER, "float32", (r,)))]))
                             for r in (7, 9)]])
    (done,) = c.process_grouped(later).responses
    assert done.rank_dims == (4, 7, 9) and not done.error


def test_a_repeated_set_of_cache_hits_is_agreed_once_with_the_same_lru_touches():
    from raytrain_x.engine.messages import Handle, Request
    from raytrain_x.engine.negotiation import JOIN_NONE, Negotiator

    def requests(names):
        return {n: Request(n, Meta(ALLREDUCE, "float32", (4,), "sum"), None, Handle(n))
                for n in names}

    negotiator = Negotiator(_OneRank, lambda vector, op: None, 8, 60.0, 0.0)
    first = negotiator.negotiate(requests("abc"), False, None, JOIN_NONE)
    assert first.reports_exchanged and [r.name for r in first.responses] == list("abc")
    assert first.plans is None  # agreed by reports, not by the cache's bits
    agreed = [negotiator.negotiate(requests(names), False, None, JOIN_NONE)
              for names in ("ca", "b", "ca")]
    assert [[r.name for r in a.responses] for a in agreed] == [["a", "c"], ["b"], ["a", "c"]]
    assert not any(a.reports_exchanged for a in agreed)
    assert agreed[0].plans is agreed[2].plans is not None  # kept with the set it belongs to
    assert agreed[0].responses[0] is agreed[2].responses[0]  # parsed once
    # each hit touched in slot order, as a get of each name would
    assert negotiator._cache.lru_order() == ["b", "a", "c"]
    assert plan_batches(agreed[2].responses, 1 << 20, agreed[2].plans) is \
        plan_batches(agreed[0].responses, 1 << 20, agreed[0].plans)
