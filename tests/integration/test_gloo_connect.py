"""Making a gloo group with a peer that dies half-way: the others fail within the job's
timeout, not torch's five connect tries of it (the hang of a node killed right after a
round formed); a peer slower to the rendezvous than a connect try is waited for."""

from __future__ import annotations

import os
import signal
import time

from tests.workers import run_workers

TIMEOUT_S = 5.0


def _group(die_after_publishing: bool, late_s: float) -> dict:
    from raytrain_x.comm.rendezvous import rendezvous_from_env
    from raytrain_x.comm.torch_backend import TorchBackend
    from raytrain_x.comm.torch_store import RayStore
    from raytrain_x.common.errors import InternalError

    rdv = rendezvous_from_env(os.environ)
    if rdv.rank == 1:
        time.sleep(late_s)
        if die_after_publishing:  # gone once its address is in the store
            put = RayStore.set

            def set_then_die(self, key, value):
                put(self, key, value)
                os.kill(os.getpid(), signal.SIGKILL)
            RayStore.set = set_then_die
    import torch

    began = time.monotonic()
    try:
        group = TorchBackend().create_group(rdv.store, "connect", rdv.rank, rdv.size,
                                            [0, 1], TIMEOUT_S)
        x = torch.ones(2)
        group.allreduce(x)  # pairs connect lazily: here, not when the group is made
    except InternalError as exc:  # in the connect, or at once in the first collective
        return {"failed_after": time.monotonic() - began, "error": str(exc)}
    return {"done_after": time.monotonic() - began, "sum": x.tolist()}


def test_a_peer_that_dies_while_the_group_connects_fails_the_others_within_the_timeout():
    env = {"RAYTRAIN_X_TIMEOUT": str(TIMEOUT_S)}
    results = run_workers(_group, 2, True, 0.0, env=env, work_s=20, allow_failures=True)
    rank0 = results[0]
    assert isinstance(rank0, dict) and "failed_after" in rank0, rank0
    # torch's own tries would take 5 x 5 s; the group fails within the job's timeout
    assert rank0["failed_after"] < TIMEOUT_S + 3, rank0
    assert "A peer process probably died" in rank0["error"]


def test_a_peer_slower_than_one_connect_try_is_waited_for():
    """Rank 1 comes 2.5 s late, more than a connect try (a fifth of the timeout): rank 0's
    first collective waits for its address and connects."""
    env = {"RAYTRAIN_X_TIMEOUT": str(TIMEOUT_S)}
    results = run_workers(_group, 2, False, 2.5, env=env, work_s=20)
    assert [r["sum"] for r in results] == [[2.0, 2.0], [2.0, 2.0]], results
    assert results[0]["done_after"] >= 2.0


def _every_collective() -> dict:
    import torch

    from raytrain_x.comm.rendezvous import rendezvous_from_env
    from raytrain_x.comm.torch_backend import TorchBackend

    rdv = rendezvous_from_env(os.environ)
    group = TorchBackend().create_group(rdv.store, "all", rdv.rank, rdv.size, [0, 1],
                                        TIMEOUT_S)
    r = rdv.rank
    x = torch.ones(3) * (r + 1)
    if r == 1:
        time.sleep(2.0)  # longer than the group's own timeout (a fifth of 5 s)
    group.allreduce(x)
    outs = [torch.zeros(2), torch.zeros(2)]
    group.allgather(outs, torch.full((2,), float(r)))
    b = torch.full((2,), float(r + 7))
    group.broadcast(b, 1)
    out = torch.zeros(2)
    group.alltoall(out, torch.tensor([10.0 * r, 10.0 * r + 1]), [1, 1], [1, 1])
    rs = torch.zeros(1)
    group.reduce_scatter(rs, torch.tensor([1.0, 2.0]) * (r + 1))
    group.barrier()
    return {"allreduce": x.tolist(), "allgather": [o.tolist() for o in outs],
            "broadcast": b.tolist(), "alltoall": out.tolist(), "reduce_scatter": rs.tolist()}


def test_every_collective_runs_over_gloo_with_the_jobs_timeout_per_op():
    """The group's own timeout is a fraction of the job's; each collective passes the
    job's (a gloo op would otherwise give up after a fifth of it)."""
    a, b = run_workers(_every_collective, 2, env={"RAYTRAIN_X_TIMEOUT": str(TIMEOUT_S)},
                       work_s=20)
    assert a["allreduce"] == b["allreduce"] == [3.0, 3.0, 3.0]
    assert a["allgather"] == [[0.0, 0.0], [1.0, 1.0]]
    assert a["broadcast"] == b["broadcast"] == [8.0, 8.0]
    assert a["alltoall"] == [0.0, 10.0] and b["alltoall"] == [1.0, 11.0]
    assert a["reduce_scatter"] == [3.0] and b["reduce_scatter"] == [6.0]
