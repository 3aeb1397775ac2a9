"""Every collective between real processes over real gloo groups (world sizes 1, 2, 3)."""

from __future__ import annotations

import pytest
import torch

from tests.workers import run_workers

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
          torch.int8, torch.uint8]
SHAPES = [(), (0,), (1,), (5,), (3, 7), (0, 3), (17, 1, 2)]


def _value(rank: int, shape, dtype) -> torch.Tensor:
    base = torch.arange(int(torch.tensor(shape).prod().item()) if shape else 1,
                        dtype=torch.float64).reshape(shape) % 7
    return (base + rank + 1).to(dtype)


def _all_ops(threshold_mb: float) -> dict:
    import raytrain_x.torch as rx

    rx.init()
    r, n = rx.rank(), rx.size()
    checks = 0
    for dtype in DTYPES:
        for shape in SHAPES:
            mine = _value(r, shape, dtype)
            everyone = [_value(k, shape, dtype) for k in range(n)]
            total = sum(e.to(torch.float64) for e in everyone)
            got = rx.allreduce(mine, op=rx.Sum, name=f"sum.{dtype}.{shape}")
            assert got.dtype == dtype and got.shape == mine.shape
            assert torch.equal(got.to(torch.float64), total), (dtype, shape)
            if dtype.is_floating_point:
                avg = rx.allreduce(mine, name=f"avg.{dtype}.{shape}")
                tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6
                assert torch.allclose(avg.double(), total / n, atol=tol, rtol=tol)
            for op, fn in ((rx.Min, torch.minimum), (rx.Max, torch.maximum)):
                want = everyone[0]
                for e in everyone[1:]:
                    want = fn(want, e)
                assert torch.equal(rx.allreduce(mine, op=op, name=f"{op}.{dtype}.{shape}"), want)
            gathered = rx.allgather(mine.reshape(-1, *shape[1:]) if shape else mine,
                                    name=f"gather.{dtype}.{shape}")
            assert torch.equal(gathered, torch.cat([e.reshape(-1, *shape[1:]) if shape
                                                    else e.reshape(1) for e in everyone]))
            b = rx.broadcast(mine, root_rank=n - 1, name=f"bcast.{dtype}.{shape}")
            assert torch.equal(b, everyone[-1])
            checks += 1
    # prescale / postscale
    x = torch.full((4,), float(r + 1))
    got = rx.allreduce(x, op=rx.Sum, prescale_factor=2.0, postscale_factor=0.5)
    assert torch.allclose(got, torch.full((4,), float(sum(range(1, n + 1)))))
    # product, in place, grouped
    p = torch.full((3,), 2.0)
    rx.allreduce_(p, op=rx.Product)
    assert torch.equal(p, torch.full((3,), 2.0 ** n))
    grouped = rx.grouped_allreduce([torch.ones(2) * r, torch.ones(3, 3) * r], op=rx.Sum)
    assert torch.equal(grouped[1], torch.full((3, 3), float(sum(range(n)))))
    # allgather with a different first dimension per rank
    g = rx.allgather(torch.full((r + 1, 2), float(r)))
    assert g.shape == (sum(range(1, n + 1)), 2)
    assert torch.equal(g[-n:], torch.full((n, 2), float(n - 1)))
    # alltoall with splits: rank r sends k+1 rows to rank k
    splits = [k + 1 for k in range(n)]
    rows = torch.arange(sum(splits), dtype=torch.float32) + 100 * r
    out, received = rx.alltoall(rows, splits=splits)
    assert received.tolist() == [r + 1] * n
    expected = torch.cat([torch.arange(sum(splits[:r]), sum(splits[: r + 1]),
                                       dtype=torch.float32) + 100 * k for k in range(n)])
    assert torch.equal(out, expected)
    # reducescatter of equal shares (the transport's own reduce-scatter), every dtype, and
    # with an average and prescaling
    for dtype in DTYPES + [torch.int16]:
        everyone = [_value(k, (2 * n, 3), dtype) for k in range(n)]
        total = sum(e.to(torch.float64) for e in everyone)
        mine = everyone[r].clone()
        rs = rx.reducescatter(mine, op=rx.Sum, name=f"rs.{dtype}")
        assert rs.dtype == dtype and torch.equal(rs.to(torch.float64), total[2 * r:2 * r + 2])
        assert torch.equal(mine, everyone[r])  # the input is left as it was
    assert rx.reducescatter(torch.zeros(0, 3), op=rx.Sum, name="rs.empty").shape == (0, 3)
    rs = rx.reducescatter(torch.ones(2 * n, 2) * (r + 1), op=rx.Average, prescale_factor=2.0)
    assert torch.allclose(rs, torch.full((2, 2), 2.0 * sum(range(1, n + 1)) / n))
    # reducescatter with an uneven first dimension
    rs = rx.reducescatter(torch.ones(2 * n + 1, 2) * (r + 1), op=rx.Sum)
    assert rs.shape[0] == (3 if r == 0 else 2) if n > 1 else rs.shape[0] == 3
    assert torch.all(rs == sum(range(1, n + 1)))
    # objects
    assert rx.broadcast_object({"from": r}, root_rank=0) == {"from": 0}
    assert rx.allgather_object(("rank", r)) == [("rank", k) for k in range(n)]
    rx.barrier()
    # fp16 compression of float32 goes through the native cast
    c = rx.allreduce(torch.full((1000,), 0.1 * (r + 1)), op=rx.Sum,
                     compression=rx.Compression.fp16)
    assert c.dtype == torch.float32
    assert torch.allclose(c, torch.full((1000,), 0.1 * sum(range(1, n + 1))), rtol=1e-3)
    return {"checks": checks, "knobs": rx.knobs().fusion_threshold_bytes,
            "transport": rx.transport()}


@pytest.mark.parametrize("size,transport", [(1, "gloo"), (2, "shm"), (3, "shm"), (2, "gloo"),
                                            (3, "gloo")])
def test_every_op_and_dtype(size, transport):
    env = {"RAYTRAIN_X_SHM": "1" if transport == "shm" else "0"}
    results = run_workers(_all_ops, size, 64.0, env=env)
    assert all(r["checks"] == len(DTYPES) * len(SHAPES) for r in results)
    assert [r["transport"] for r in results] == [transport] * size


# a 12 MB buffer's views, as DistributedOptimizer's gradients are: two small, three of 4 MB
ARENA_CUTS = [0, 10, 1_000_010, 2_000_010, 2_000_020, 3_000_000]


def _spans() -> list[tuple[int, int]]:
    return list(zip(ARENA_CUTS, ARENA_CUTS[1:]))


def _large_batch() -> dict:
    """Fused batches with tensors of a MB or more, and one of small tensors only: how each
    was reduced (in pieces on the wire, or packed whole) and whether the results are
    right."""
    import raytrain_x.torch as rx
    from raytrain_x.core import runtime

    rx.init()
    r, n = rx.rank(), rx.size()
    stats = runtime.engine().stats
    total = sum(range(1, n + 1))
    big = [torch.full((1_000_000 + 17 * k,), float(r + 1)) for k in range(3)]  # 4 MB each
    mixed = [torch.full((5,), float(r + 1)), big[0], torch.full((3, 7), float(r + 1)), *big[1:]]
    before = stats.fused_in_place
    averaged = rx.grouped_allreduce(big, name="big.avg")
    summed = rx.grouped_allreduce(mixed, op=rx.Sum, prescale_factor=2.0, postscale_factor=0.25,
                                  name="mixed.sum")
    # rank 0's tensors are views of one buffer, back to back (it could reduce them as one
    # span), the others' separate: every rank must send the same pieces
    flat = torch.full((2_500_100,), float(r + 1))
    parts = ([flat[:1_000_000], flat[1_000_000:1_000_100], flat[1_000_100:]] if r == 0 else
             [torch.full((n_,), float(r + 1)) for n_ in (1_000_000, 100, 1_500_000)])
    rx.grouped_allreduce_(parts, op=rx.Sum, name="layouts")
    large_in_place = stats.fused_in_place - before
    # batch after batch on the wire (each one's last pieces cross while the next is agreed),
    # waited for in the opposite order
    waves = [[torch.full((400_000 + k,), float((r + 1) * (w + 1))) for k in range(3)]
             for w in range(4)]
    handles = [rx.grouped_allreduce_async_(wave, op=rx.Sum, name=f"wave{w}")
               for w, wave in enumerate(waves)]
    for h in reversed(handles):
        rx.synchronize(h)
    # every rank's tensors views of one buffer (DistributedOptimizer's gradients): they
    # cross together, up to 25 MB a piece; then rank 1's lie apart under the same names (it
    # packs those pieces, the others still send theirs in place)
    arena = torch.full((ARENA_CUTS[-1],), float(r + 1))
    views = [arena[a:b] for a, b in _spans()]
    # the first batch of these names sends each rank's layout with the next status word
    # (and crosses piece by piece); from then on they cross together
    pieces = stats.in_flight_pieces
    rx.grouped_allreduce_(views, op=rx.Sum, name="arena")
    first_arena_pieces = stats.in_flight_pieces - pieces
    arena.fill_(float(r + 1))
    pieces = stats.in_flight_pieces
    rx.grouped_allreduce_(views, op=rx.Sum, name="arena")
    arena_pieces = stats.in_flight_pieces - pieces
    apart = ([torch.full((b - a,), float(r + 1)) for a, b in _spans()] if r == 1
             else [arena[a:b].fill_(float(r + 1)) for a, b in _spans()])
    rx.grouped_allreduce_(apart, op=rx.Sum, name="arena")
    # a single array of a MB or more is one piece on the stream (the engine goes on while
    # it crosses), floats averaged as it lands, integers scaled after
    pieces, before = stats.in_flight_pieces, stats.fused_in_place
    single = torch.full((600_000,), float(r + 1))
    rx.allreduce_(single, name="single")
    ints = torch.full((300_000,), r + 1, dtype=torch.int64)
    rx.allreduce_(ints, op=rx.Sum, postscale_factor=2.0, name="single.int")
    single_pieces, single_fused = stats.in_flight_pieces - pieces, stats.fused_in_place - before
    before = stats.fused_in_place
    small = rx.grouped_allreduce([torch.full((10,), float(r + 1)), torch.ones(20) * (r + 1)],
                                 op=rx.Sum, name="small")
    return {
        "average": all(torch.allclose(t, torch.full_like(t, total / n)) for t in averaged),
        "scaled_sum": all(t.shape == m.shape and torch.allclose(t, torch.full_like(t, total / 2))
                          for t, m in zip(summed, mixed)),
        "inputs_kept": all(torch.equal(t, torch.full_like(t, float(r + 1))) for t in mixed),
        "small": all(torch.equal(t, torch.full_like(t, float(total))) for t in small),
        "layouts": all(torch.equal(p, torch.full_like(p, float(total)))
                       for p in [*parts, *views, *apart]),
        "arena_pieces": (first_arena_pieces, arena_pieces),
        "singles": (torch.allclose(single, torch.full_like(single, total / n))
                    and torch.equal(ints, torch.full_like(ints, 2 * total))),
        "single_pieces": (single_pieces, single_fused),
        "waves": all(torch.equal(t, torch.full_like(t, float(total * (w + 1))))
                     for w, wave in enumerate(waves) for t in wave),
        "large_in_place": large_in_place,
        "small_in_place": stats.fused_in_place - before,
    }


def _arena_in_a_process_set() -> dict:
    import raytrain_x.torch as rx
    from raytrain_x.core import runtime

    rx.init()
    r = rx.rank()
    stats = runtime.engine().stats
    pair = rx.add_process_set([0, 1])
    arena = torch.full((ARENA_CUTS[-1],), float(r + 1))
    views = [arena[a:b] for a, b in _spans()]
    pieces = []
    for _ in range(3 if r in pair.ranks else 0):  # the world's layout: agreed after one
        arena.fill_(float(r + 1))
        before = stats.in_flight_pieces
        rx.grouped_allreduce_(views, op=rx.Sum, name="set.arena", process_set=pair)
        pieces.append(stats.in_flight_pieces - before)
    right = not pieces or all(torch.equal(v, torch.full_like(v, 3.0)) for v in views)
    rx.barrier()  # rank 2, outside the set, waits for the set's collectives
    rx.shutdown()
    return {"pieces": pieces, "right": right}


def test_a_process_sets_arrays_cross_apart_every_time_and_right():
    # the layout is agreed in the world's status word, which is not a process set's: its
    # arrays back to back are never asked about, and cross as the sizes alone cut them
    results = run_workers(_arena_in_a_process_set, 3, env={"RAYTRAIN_X_SHM": "0"})
    assert results == [{"pieces": [4, 4, 4], "right": True}] * 2 + [{"pieces": [],
                                                                       "right": True}]


@pytest.mark.parametrize("size", [2, 3])
def test_across_a_network_a_large_batch_crosses_in_pieces(size):
    # Over a network a fused batch with tensors of a MB or more crosses in pieces, two on the
    # wire at once: each such tensor where it lies, the small ones packed together, each
    # piece scaled beside another's transfer, whether or not a rank's tensors lie back to
    # back; tensors that lie back to back on every rank cross together, up to 25 MB a piece;
    # a batch of small tensors only is packed whole.
    results = run_workers(_large_batch, size, env={"RAYTRAIN_X_SHM": "0"})
    for res in results:
        assert res["average"] and res["scaled_sum"] and res["inputs_kept"] and res["small"]
        assert res["layouts"]
        assert res["large_in_place"] == 3 and res["small_in_place"] == 0
        # 12 MB back to back: one piece, once every rank's layout was agreed (the first
        # batch: each large tensor a piece, the small ones packed together)
        assert res["arena_pieces"] == (4, 1)
        assert res["singles"] and res["single_pieces"] == (2, 0)
        assert res["waves"]


def _transport() -> str:
    import raytrain_x.torch as rx

    rx.init()
    return rx.transport()


def test_shared_memory_only_when_every_rank_can_use_it():
    # one rank without shared memory: all fall back to gloo together (no hang)
    assert run_workers(_transport, 2, env={"RAYTRAIN_X_SHM": "1"}) == ["shm", "shm"]
    # two "hosts": the world spans hosts, so gloo, with shared memory for the local stages
    # of hierarchical allreduce (opened even while that knob is off: autotune may turn it on)
    assert run_workers(_transport, 4, hosts=2) == ["gloo+shm"] * 4


def _one_rank_opts_out() -> str:
    import os

    import raytrain_x.torch as rx

    if int(os.environ["RAYTRAIN_X_RANK"]) == 1:
        os.environ["RAYTRAIN_X_SHM"] = "0"
    rx.init()
    got = rx.allreduce(torch.ones(3), op=rx.Sum, name="after_fallback")
    assert torch.equal(got, torch.full((3,), 2.0))
    return rx.transport()


def test_one_rank_without_shared_memory_makes_all_use_gloo():
    assert run_workers(_one_rank_opts_out, 2) == ["gloo", "gloo"]


def test_every_op_without_fusion_or_cache():
    env = {"RAYTRAIN_X_FUSION_THRESHOLD": "0", "RAYTRAIN_X_CACHE_CAPACITY": "0"}
    results = run_workers(_all_ops, 2, 0.0, env=env)
    assert [r["knobs"] for r in results] == [0, 0]


def _out_of_order() -> list[bool]:
    import raytrain_x.torch as rx

    rx.init()
    handles = [rx.allreduce_async(torch.ones(10) * i, name=f"t{i}", op=rx.Sum) for i in range(20)]
    results = []
    for i in reversed(range(20)):  # wait in the opposite order of submission
        results.append(torch.equal(rx.synchronize(handles[i]), torch.ones(10) * i * rx.size()))
    # ranks submit the same names in different orders: negotiation still pairs them by name
    names = [f"shuffled{i}" for i in range(8)]
    order = names if rx.rank() == 0 else list(reversed(names))
    hs = {name: rx.allreduce_async(torch.full((3,), float(names.index(name))), name=name,
                                   op=rx.Sum) for name in order}
    for name in names:
        results.append(bool(torch.all(rx.synchronize(hs[name]) == 2 * names.index(name))))
    assert rx.poll(hs[names[0]])
    return results


def test_async_handles_complete_out_of_order():
    for res in run_workers(_out_of_order, 2):
        assert all(res)


def _fused_result(seed: int) -> list:
    import raytrain_x.torch as rx

    rx.init()
    g = torch.Generator().manual_seed(seed + rx.rank())
    tensors = [torch.randn(s, generator=g) for s in [(3,), (100, 3), (1,), (7, 7), (4096,)]]
    handles = [rx.allreduce_async(t, name=f"w{i}") for i, t in enumerate(tensors)]
    return [rx.synchronize(h) for h in handles]


def test_fused_and_unfused_results_identical():
    fused = run_workers(_fused_result, 2, 0)
    unfused = run_workers(_fused_result, 2, 0, env={"RAYTRAIN_X_FUSION_THRESHOLD": "0"})
    for a, b in zip(fused[0], unfused[0]):
        assert torch.equal(a, b)
    for a, b in zip(fused[0], fused[1]):
        assert torch.equal(a, b)


def _hierarchical() -> list:
    import raytrain_x.torch as rx

    rx.init()
    assert rx.cross_size() == 2 and rx.local_size() == 2
    x = torch.arange(11, dtype=torch.float32) * (rx.rank() + 1)
    flat = rx.allreduce(x, op=rx.Sum, name="h")
    g = rx.allgather(torch.full((2, 3), float(rx.rank())), name="hg")
    # larger than a shared-memory slot, and not a multiple of the local size
    big = torch.arange(300_001, dtype=torch.float64) * (rx.rank() + 1)
    big_sum = rx.allreduce(big, op=rx.Sum, name="big")
    # several 4 MB pipeline chunks, the last one short
    huge = (torch.arange(3_000_001, dtype=torch.float32) % 1000) * (rx.rank() + 1)
    huge_sum = rx.allreduce(huge, op=rx.Sum, name="huge")
    assert torch.equal(huge_sum, (torch.arange(3_000_001, dtype=torch.float32) % 1000) * 10)
    # an average through the pipelined chunks
    huge_avg = rx.allreduce(huge, op=rx.Average, name="huge_avg")
    assert torch.equal(huge_avg, (torch.arange(3_000_001, dtype=torch.float32) % 1000) * 2.5)
    # an allgather larger than a slot, in a dtype of its own
    wide = rx.allgather(torch.full((70_000,), rx.rank(), dtype=torch.int32), name="wide")
    assert torch.equal(wide, torch.arange(4, dtype=torch.int32).repeat_interleave(70_000))
    from raytrain_x.core import runtime

    return [flat, g, big_sum, rx.transport(), runtime.engine().hierarchical_allreduce_applies]


@pytest.mark.parametrize("transport", ["gloo+shm", "gloo"])
def test_hierarchical_allreduce_and_allgather_match_flat(transport):
    """On by default; without shared memory on the hosts allreduce goes flat (the hosts
    agree on it) while allgather keeps its local stage over gloo."""
    env = {"RAYTRAIN_X_HIERARCHICAL_ALLGATHER": "1",
           "RAYTRAIN_X_SHM": "1" if transport == "gloo+shm" else "0"}
    results = run_workers(_hierarchical, 4, env=env, hosts=2)
    expected = torch.arange(11, dtype=torch.float32) * 10
    expected_gather = torch.cat([torch.full((2, 3), float(r)) for r in range(4)])
    expected_big = torch.arange(300_001, dtype=torch.float64) * 10
    for flat, gathered, big, used, applies in results:
        assert torch.equal(flat, expected)
        assert torch.equal(gathered, expected_gather)
        assert torch.equal(big, expected_big)
        assert used == transport
        assert applies == (transport == "gloo+shm")


def _scaled_across_hosts() -> str:
    """Averages and scaled sums over gloo (one rank per host), large and small."""
    import raytrain_x.torch as rx

    rx.init()
    base = torch.arange(2_500_003, dtype=torch.float32) % 977  # 10 MB
    x = base * (rx.rank() + 1)
    assert torch.equal(rx.allreduce(x, op=rx.Average, name="avg"), base * 1.5)
    scaled = rx.allreduce(x, op=rx.Sum, prescale_factor=0.5, postscale_factor=4.0,
                          name="scaled")
    assert torch.equal(scaled, base * 6)
    # 16-bit floats: gloo sums them widened; 3 * 499 * 0.5 and every step before it exact
    hbase = (torch.arange(5_000_001) % 500).half()
    half = rx.allreduce(hbase * (rx.rank() + 1), op=rx.Average, name="half")
    assert torch.equal(half, hbase * 1.5)
    small = rx.allreduce(x[:1000], op=rx.Average, name="small")
    assert torch.equal(small, base[:1000] * 1.5)
    return rx.transport()


def test_scaled_allreduces_across_hosts_match():
    assert run_workers(_scaled_across_hosts, 2, hosts=2) == ["gloo", "gloo"]


def _shm_local_stage() -> dict:
    """Hierarchical allgather alone: how many barriers this host's segment passed."""
    import raytrain_x.torch as rx
    from raytrain_x.core import runtime

    rx.init()
    local_shm = runtime.engine()._transport._local_shm
    before = local_shm.barriers
    g = rx.allgather(torch.full((3, 2), float(rx.rank())), name="g")
    assert torch.equal(g, torch.arange(4.0).repeat_interleave(3)[:, None].expand(12, 2))
    return {"barriers": local_shm.barriers - before}


def test_hierarchical_allgather_local_stage_goes_through_shared_memory():
    env = {"RAYTRAIN_X_HIERARCHICAL_ALLGATHER": "1", "RAYTRAIN_X_SHM": "1"}
    assert all(r["barriers"] > 0 for r in run_workers(_shm_local_stage, 4, env=env, hosts=2))


def _sets_on_hosts() -> dict:
    import raytrain_x.torch as rx

    rx.init()
    rank = rx.rank()
    host0 = rx.add_process_set([0, 1])  # one host: shared memory
    across = rx.add_process_set([0, 2])  # two hosts: gloo
    out = {"global": rx.transport(), "host0": rx.transport(host0),
           "across": rx.transport(across)}
    if host0.included():
        out["sum"] = rx.allreduce(torch.full((5,), rank + 1.0), op=rx.Sum, name="s",
                                  process_set=host0).tolist()
        out["max"] = rx.allreduce(torch.tensor([rank]), op=rx.Max, name="m",
                                  process_set=host0).item()
        grouped = rx.grouped_allreduce([torch.ones(3) * rank, torch.ones(100_000) * rank],
                                       op=rx.Average, name="g", process_set=host0)
        out["grouped"] = [float(t.mean()) for t in grouped]
        out["gather"] = rx.allgather(torch.full((2,), rank), name="a",
                                     process_set=host0).tolist()
    if across.included():
        out["across_sum"] = rx.allreduce(torch.ones(2) * rank, op=rx.Sum, name="x",
                                         process_set=across).tolist()
    rx.allreduce(torch.ones(1), name="everyone-done")
    assert rx.remove_process_set(host0)
    return out


def test_process_sets_on_one_host_use_shared_memory():
    results = run_workers(_sets_on_hosts, 4, hosts=2)
    for rank, r in enumerate(results):
        assert r["global"] == "gloo+shm"  # each host keeps a segment for local stages
        assert r["host0"] == ("shm" if rank in (0, 1) else "none")
        assert r["across"] == ("gloo" if rank in (0, 2) else "none")
    for r in results[:2]:
        assert r["sum"] == [3.0] * 5 and r["max"] == 1
        assert r["grouped"] == [0.5, 0.5] and r["gather"] == [0, 0, 1, 1]
    assert results[0]["across_sum"] == results[2]["across_sum"] == [2.0, 2.0]


def _init_again_after_refused_sets() -> dict:
    import raytrain_x.torch as rx

    out: dict = {}
    try:
        rx.init(process_sets=[rx.ProcessSet([0, 7])])
    except rx.ConfigError as exc:
        out["refused"] = str(exc)
    try:  # the first set is fine, the second repeats it: neither is registered
        rx.init(process_sets=[rx.ProcessSet([0]), rx.ProcessSet([0])])
    except ValueError as exc:  # Horovod's test_process_sets_static expects a ValueError
        out["twice"] = str(exc)
    zero = rx.ProcessSet([0])
    rx.init(process_sets=[zero])
    out["zero"] = zero.process_set_id
    ones = rx.ProcessSet([1])
    rx.init(process_sets=[ones])  # Horovod registers the sets of the second init
    out["id"] = ones.process_set_id
    if ones.included():
        out["sum"] = rx.allreduce(torch.ones(1), op=rx.Sum, process_set=ones).item()
    rx.init(process_sets=[ones])  # registered already: left as it is
    out["same_id"] = ones.process_set_id
    rx.shutdown()
    return out


def test_init_again_registers_the_process_sets_a_failed_init_did_not():
    """After an `init(process_sets=...)` whose sets were refused, a second `init` with sets
    that are right did nothing (the runtime had started), and the sets stayed unregistered.
    A list refused for a set it names twice registered the first copy, so the same set in
    the next `init` was refused as "already exists": a list is registered whole or not at
    all."""
    for out in run_workers(_init_again_after_refused_sets, 2):
        assert "0..1" in out["refused"]
        assert "earlier in the same list" in out["twice"] and out["zero"] is not None
        assert out["id"] is not None and out["id"] == out["same_id"]
        assert out.get("sum", 1.0) == 1.0


def _process_sets() -> dict:
    import raytrain_x.torch as rx

    evens = rx.ProcessSet([0, 2])
    rx.init(process_sets=[evens])
    odd = rx.add_process_set([1])
    out: dict = {"sets": [], "world": []}
    # unnamed: each set counts its own names, and the repeats come from the response cache
    # (whose bits a rank outside a set agrees to without submitting anything)
    for _ in range(3):
        if evens.included():
            out["sets"].append(rx.allreduce(torch.ones(2) * rx.rank(), op=rx.Sum,
                                            process_set=evens))
        if odd.included():
            out["sets"].append(rx.allreduce(torch.ones(2) * 5, op=rx.Sum, process_set=odd))
        out["world"].append(rx.allreduce(torch.ones(1), op=rx.Sum))
    try:  # refused at once, on this rank alone
        rx.allreduce(torch.ones(1), process_set=evens if odd.included() else odd)
    except ValueError as exc:
        out["outside"] = str(exc)
    assert rx.remove_process_set(odd)
    return out


def test_process_sets():
    results = run_workers(_process_sets, 3)
    for r, out in enumerate(results):
        want = torch.full((2,), 5.0 if r == 1 else 2.0)
        assert len(out["sets"]) == 3 and all(torch.equal(t, want) for t in out["sets"])
        assert all(torch.equal(t, torch.full((1,), 3.0)) for t in out["world"])
        assert f"rank {r} is not a member of process set" in out["outside"]


def _join() -> tuple:
    import raytrain_x.torch as rx

    rx.init()
    steps = 2 if rx.rank() == 0 else 4  # rank 0 runs out of data first
    sums = []
    for step in range(steps):
        sums.append(rx.allreduce(torch.ones(3), op=rx.Sum, name=f"step{step}")[0].item())
    last = rx.join()
    return sums, last


def test_join_lets_a_rank_finish_early():
    results = run_workers(_join, 2)
    assert results[0] == ([2.0, 2.0], 1)
    assert results[1] == ([2.0, 2.0, 1.0, 1.0], 1)


def _staged_ways() -> list:
    """The allgather and reduce-scatter CUDA tensors take over gloo (ranks sharing a GPU),
    on host tensors: the same broadcasts and alltoall."""
    import raytrain_x.torch as rx
    from raytrain_x.core import runtime

    rx.init()
    group = runtime.engine()._transport.groups.world
    r, n = rx.rank(), rx.size()
    out = torch.empty(n * 4, 3)
    group.gather_by_broadcasts(out, torch.full((4, 3), float(r)))
    # the own block already in its slot, in a dtype gloo moves as bytes
    in_place = torch.zeros(n * 5, dtype=torch.int16)
    in_place[r * 5:(r + 1) * 5] = r + 1
    group.gather_by_broadcasts(in_place, in_place[r * 5:(r + 1) * 5])
    share = torch.empty(2, 3)
    group.reduce_scatter_by_alltoall(share, torch.arange(n * 6.0).reshape(n * 2, 3) * (r + 1))
    narrow = torch.empty(4, dtype=torch.int16)
    group.reduce_scatter_by_alltoall(narrow, torch.arange(n * 4, dtype=torch.int16))
    return [out, in_place, share, narrow]


def test_the_ways_of_cuda_tensors_over_gloo_fill_every_members_share():
    n = 3
    for r, (out, in_place, share, narrow) in enumerate(run_workers(_staged_ways, n)):
        assert torch.equal(out, torch.arange(3.0).repeat_interleave(4)[:, None].expand(12, 3))
        assert torch.equal(in_place, torch.arange(1, 4, dtype=torch.int16).repeat_interleave(5))
        assert torch.equal(share, torch.arange(r * 6.0, r * 6.0 + 6).reshape(2, 3) * 6)
        assert torch.equal(narrow, torch.arange(r * 4, r * 4 + 4, dtype=torch.int16) * n)


def _into_buffers() -> list:
    """A reduce-scatter and an allgather into the caller's buffers: the handle gives the
    buffer itself, holding the result; a buffer that does not fit is left alone and the
    result comes as a new tensor."""
    import raytrain_x.torch as rx
    from raytrain_x.core.collectives import synchronize
    from raytrain_x.torch.async_ops import allgather_into_async, reducescatter_into_async

    rx.init()
    n, me = rx.size(), rx.rank()
    grads = torch.arange(6.0 * n) * (me + 1)
    expected = (torch.arange(6.0 * n) * sum(range(1, n + 1)))[6 * me:6 * (me + 1)]
    out = []
    for name, buffer in (("fits", torch.full((6,), -1.0)), ("too_long", torch.zeros(7)),
                         ("other_dtype", torch.zeros(6, dtype=torch.float64))):
        got = synchronize(reducescatter_into_async(grads, buffer, f"rs.{name}", rx.Sum,
                                                   rx.global_process_set))
        out.append((name, got.data_ptr() == buffer.data_ptr(), torch.equal(got, expected),
                    bool((buffer == -1).all()) if name == "fits" else None))
    gathered = torch.zeros(3 * n)
    got = synchronize(allgather_into_async(torch.full((3,), float(me)), gathered, "ag.fits"))
    out.append(("allgather", got.data_ptr() == gathered.data_ptr(),
                torch.equal(got, torch.arange(n).float().repeat_interleave(3)), None))
    return out


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_reduce_scatter_and_allgather_write_into_a_callers_buffer_that_fits(transport):
    for out in run_workers(_into_buffers, 2, env={"RAYTRAIN_X_SHM": "1" if transport == "shm"
                                                  else "0"}):
        assert out == [("fits", True, True, False), ("too_long", False, True, None),
                       ("other_dtype", False, True, None), ("allgather", True, True, None)]


def _nan_max_min() -> dict:
    """Max and Min where a NaN comes from one rank only: element 0 from the last rank,
    element 1 from rank 0, element 2 from none (a large tensor too, one NaN deep inside)."""
    import raytrain_x.torch as rx

    rx.init()
    rank, last = rx.rank(), rx.size() - 1
    out = {}
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        x = torch.tensor([1.0, -2.0, -0.5 - rank], dtype=dtype)
        x[0] = float("nan") if rank == last else x[0]
        x[1] = float("nan") if rank == 0 else x[1]
        for op in (rx.Max, rx.Min):
            got = rx.allreduce(x, op=op, name=f"nan.{dtype}.{op}")
            out[f"{dtype}.{op}"] = [torch.isnan(got[:2]).tolist(), got[2].item()]
    big = torch.arange(100_003, dtype=torch.float32)
    if rank == last:
        big[77_777] = float("nan")
    got = rx.allreduce(big, op=rx.Max, name="nan.big")
    out["big"] = [torch.isnan(got).nonzero().flatten().tolist(), got[5].item()]
    out["transport"] = rx.transport()
    rx.shutdown()
    return out


@pytest.mark.parametrize("size,transport", [(2, "shm"), (3, "shm"), (2, "gloo")])
def test_max_and_min_keep_a_nan_from_any_rank(size, transport):
    """A divergence check by `allreduce(x, op=Max)` sees a NaN whichever rank has it (it was
    kept only when it came from rank 0: the shared-memory combine and gloo's compare)."""
    env = {"RAYTRAIN_X_SHM": "1" if transport == "shm" else "0"}
    for out in run_workers(_nan_max_min, size, env=env, work_s=60):
        assert out.pop("transport") == transport
        assert out.pop("big") == [[77_777], 5.0]
        for key, (nans, third) in out.items():
            assert nans == [True, True], key
            assert third == (-0.5 if key.endswith("max") else -0.5 - (size - 1)), key
