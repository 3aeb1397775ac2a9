"""Horovod's torch API details between real processes: init after shutdown, error types a
Horovod script catches, every dtype through the data-moving collectives, integer scaling,
build queries, `mpi_ops` and the timeline switches."""

from __future__ import annotations

import json

import pytest
import torch

from tests.workers import run_workers

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.bool]


def _api(timeline: str) -> dict:
    import raytrain_x.torch as rx

    out: dict = {}
    rx.init(process_sets="dynamic")
    r, n = rx.rank(), rx.size()
    first = rx.allreduce(torch.ones(2), op=rx.Sum)
    rx.shutdown()
    out["initialized_after_shutdown"] = rx.is_initialized()
    rx.init()  # again, in the same process (Horovod re-initialises)
    out["again"] = (rx.rank(), rx.size()) == (r, n) and torch.equal(
        rx.allreduce(torch.ones(2), op=rx.Sum, name="again"), first)
    # every dtype Horovod supports through allgather, broadcast and alltoall
    for dtype in DTYPES:
        mine = (torch.arange(2 * n) % 2 + r).to(dtype)
        out[f"allgather.{dtype}"] = rx.allgather(mine)
        out[f"broadcast.{dtype}"] = rx.broadcast(mine, 0)
        out[f"alltoall.{dtype}"] = rx.alltoall(mine)
    # integers scaled in float64 and cast back, as Horovod does
    out["int_prescale"] = rx.allreduce(torch.tensor([10, -7, 3]), op=rx.Sum,
                                       prescale_factor=0.5)
    out["int_postscale"] = rx.reducescatter(torch.tensor([10, -7, 3, 9] * n), op=rx.Sum,
                                            postscale_factor=0.25)
    out["int16_sum"] = rx.allreduce(torch.tensor([300, -2], dtype=torch.int16), op=rx.Sum)
    # Horovod's error types
    errors = {}
    try:
        rx.reducescatter(torch.ones(4), op=rx.Adasum)
    except RuntimeError as exc:
        errors["reducescatter_adasum"] = type(exc).__name__
    try:
        rx.allreduce(torch.ones(3 + r))  # ranks disagree on the shape
    except RuntimeError as exc:
        errors["mismatch"] = isinstance(exc, rx.HorovodInternalError) or type(exc).__name__
    out["errors"] = errors
    # join: rank 0 is done; rank 1 still reduces (rank 0 adds zeros) and its allgather
    # fails as Horovod's does; both learn that rank 1 joined last
    if r == 0:
        out["joined_last"] = rx.join()
    else:
        out["joined_sum"] = rx.allreduce(torch.full((3,), 4.0), op=rx.Sum, name="after_join")
        try:
            rx.allgather(torch.ones(2), name="gather_after_join")
        except RuntimeError as exc:
            errors["allgather_after_join"] = type(exc).__name__
        out["joined_last"] = rx.join()
    # Horovod's argument forms
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(r)
    rx.broadcast_parameters(list(model.parameters()), root_rank=1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1 * (r + 1))
    rx.broadcast_optimizer_state(opt, 1, model)  # Horovod's positional model=
    out["forms"] = (float(model.weight[0, 0]), opt.param_groups[0]["lr"])
    # horovod.torch.mpi_ops: its module path, its handles, and the process-set query
    from raytrain_x.torch.mpi_ops import _basics, allreduce_async_, synchronize
    second = rx.add_process_set([1])
    out["sets"] = _basics._get_process_set_ids_and_ranks()
    rx.remove_process_set(second)
    out["mpi_ops"] = synchronize(allreduce_async_(torch.ones(2), op=rx.Sum)).tolist()
    out["basics_size"] = _basics.size()
    out["queries"] = (rx.gloo_built(), rx.gloo_enabled(), rx.mpi_built(), rx.mpi_enabled(),
                      rx.ccl_built(), rx.is_homogeneous())
    rx.start_timeline(timeline, mark_cycles=True)
    rx.allreduce(torch.ones(3), name="traced")
    rx.start_timeline(timeline, mark_cycles=True)  # the same file again: kept as it is
    rx.stop_timeline()
    rx.shutdown()
    return out


def test_horovod_details(tmp_path):
    timeline = tmp_path / "timeline.json"
    results = run_workers(_api, 2, str(timeline), work_s=15)
    n = 2
    for r, got in enumerate(results):
        assert got["initialized_after_shutdown"] is False and got["again"]
        for dtype in DTYPES:
            everyone = [(torch.arange(2 * n) % 2 + k).to(dtype) for k in range(n)]
            assert torch.equal(got[f"allgather.{dtype}"], torch.cat(everyone)), dtype
            assert torch.equal(got[f"broadcast.{dtype}"], everyone[0]), dtype
            want = torch.cat([e[2 * r:2 * r + 2] for e in everyone])
            assert torch.equal(got[f"alltoall.{dtype}"], want), dtype
        # each rank's (10 * 0.5, -7 * 0.5 -> -3, 3 * 0.5 -> 1), summed
        assert got["int_prescale"].tolist() == [10, -6, 2]
        assert got["int_postscale"].tolist() == [5, -3, 1, 4]  # (20, -14, 6, 18) / 4
        assert got["int16_sum"].dtype == torch.int16 and got["int16_sum"].tolist() == [600, -4]
        want_errors = {"reducescatter_adasum": "UnsupportedOperationError",
                       "mismatch": "TensorMismatchError"}
        if r == 1:
            want_errors["allgather_after_join"] = "TensorMismatchError"
            assert got["joined_sum"].tolist() == [4.0, 4.0, 4.0]
        assert got["errors"] == want_errors
        assert got["joined_last"] == 1
        assert got["forms"] == (1.0, 0.2)
        assert got["sets"] == {0: [0, 1], 1: [1]}
        assert got["mpi_ops"] == [2.0, 2.0] and got["basics_size"] == 2
        assert got["queries"] == (True, True, False, False, False, True)
    events = json.loads(timeline.read_text())
    assert "start_time_since_epoch_in_micros" in json.dumps(events[0])
    names = {e.get("name") for e in events}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "CYCLE_START"} <= names
    rows = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert "allreduce.traced" in rows


def _set_registered_late_on_rank_0(replicated_up_to: int, marker: str) -> dict:
    from pathlib import Path

    import raytrain_x.torch as rx
    from raytrain_x.engine import negotiation
    from tests.limits import wait_until

    negotiation.REPLICATED_UP_TO = replicated_up_to
    rx.init(process_sets="dynamic")
    r = rx.rank()
    if r == 0:  # rank 1 registers the set and has its result before rank 0 registers it
        wait_until(Path(marker).exists, 20, "rank 1's result from the set")
    odd = rx.add_process_set([1])
    out: dict = {"set": rx.allreduce(torch.full((2,), 3.0), op=rx.Sum,
                                     process_set=odd).tolist() if r == 1 else []}
    if r == 1:
        Path(marker).touch()
    # rows of each rank's own: reports that differ; then a mismatch named by rank
    out["rows"] = rx.allgather(torch.full((r + 1, 2), float(r))).shape[0]
    try:
        rx.allreduce(torch.ones(2 + (r == 2)), name="mismatch")
    except rx.HorovodInternalError as exc:
        out["mismatch"] = str(exc)
    except Exception as exc:  # noqa: BLE001 - the error's type is asserted by the test
        out["mismatch"] = f"{type(exc).__name__}: {exc}"
    rx.shutdown()
    return out


@pytest.mark.parametrize("replicated_up_to", [16, 0], ids=["every-rank", "rank-0"])
def test_a_set_rank_0_registers_after_its_members_submit_to_it_still_runs(replicated_up_to,
                                                                         tmp_path):
    """A negotiating cycle is decided on every rank (a small world) or on rank 0 (a large
    one: `negotiation.REPLICATED_UP_TO`, lowered here to take that way with 3 ranks), and
    each rank registers a process set on its own: a set's members may submit before rank 0
    has registered it (Horovod's own process-set tests do). Rank 0 decides it from the
    members the reports carry; differing reports and a mismatch decide alike both ways."""
    results = run_workers(_set_registered_late_on_rank_0, 3, replicated_up_to,
                          str(tmp_path / "rank1-done"), work_s=30)
    assert [r["set"] for r in results] == [[], [3.0, 3.0], []]
    assert [r["rows"] for r in results] == [6, 6, 6]
    for r in results:
        assert "ranks [0, 1] have allreduce float32[2]" in r["mismatch"], r["mismatch"]
        assert "ranks [2] have allreduce float32[3]" in r["mismatch"], r["mismatch"]
