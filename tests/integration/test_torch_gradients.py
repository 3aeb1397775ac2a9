"""Gradients through every collective between real processes over real gloo (2 and 3
ranks, shared memory and gloo transports): each rank's gradient equals the gradient that
one process computes for the same computation on the combined batch, under Horovod's rules
(raytrain_x/torch/autograd.py)."""

from __future__ import annotations

import pytest
import torch

from tests.workers import run_workers

ROWS = [3, 1, 4]  # uneven first dimensions per rank


def _rows(rank: int, dim: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(ROWS[rank], dim, generator=g, dtype=torch.float64)


def _contrastive(embeddings: torch.Tensor) -> torch.Tensor:
    """A CLIP-style loss over every embedding: softmax cross-entropy of each row against
    its own index, from the rows' similarity matrix."""
    z = torch.nn.functional.normalize(embeddings, dim=1)
    logits = z @ z.t() / 0.5
    return torch.nn.functional.cross_entropy(logits, torch.arange(len(z)))


def _gradients() -> dict:
    import raytrain_x.torch as rx

    rx.init()
    r, n = rx.rank(), rx.size()
    out: dict = {}
    # allgather: every rank computes the same loss on the gathered batch
    x = _rows(r).requires_grad_()
    _contrastive(rx.allgather(x, name="emb")).backward()
    out["allgather"] = x.grad
    # grouped allgather: two tensors, one loss
    a, b = _rows(r).requires_grad_(), (_rows(r) * 2).requires_grad_()
    ga, gb = rx.grouped_allgather([a, b], name="pair")
    _contrastive(torch.cat([ga, gb], dim=1)).backward()
    out["grouped_allgather"] = (a.grad, b.grad)
    # allreduce, Sum and Average, with factors; grouped
    y = torch.full((4,), float(r + 1), dtype=torch.float64, requires_grad=True)
    (rx.allreduce(y, op=rx.Sum, prescale_factor=2.0, postscale_factor=0.5) * torch.arange(4.)
     ).sum().backward()
    out["allreduce_sum"] = y.grad
    y2 = torch.ones(3, dtype=torch.float64, requires_grad=True)
    s0, s1 = rx.grouped_allreduce([y2, y2 * 3], op=rx.Average)
    (s0.sum() + 2 * s1.sum()).backward()
    out["grouped_allreduce"] = y2.grad
    # broadcast from the last rank
    w = torch.full((3,), float(r), dtype=torch.float64, requires_grad=True)
    (rx.broadcast(w, n - 1) ** 2).sum().backward()
    out["broadcast"] = w.grad
    # alltoall with uneven splits: rank r sends k+1 rows to rank k
    splits = [k + 1 for k in range(n)]
    t = torch.arange(sum(splits) * 2, dtype=torch.float64).reshape(-1, 2).add(10 * r)
    t.requires_grad_()
    got, received = rx.alltoall(t, splits=splits)
    (got * (r + 1)).sum().backward()
    out["alltoall"] = (t.grad, received.tolist())
    # reducescatter, Sum (uneven rows) and Average; grouped
    u = torch.ones(2 * n + 1, 2, dtype=torch.float64, requires_grad=True)
    rx.reducescatter(u, op=rx.Sum).sum().backward()
    out["reducescatter_sum"] = u.grad
    v = torch.ones(2 * n, 3, dtype=torch.float64, requires_grad=True)
    (c,) = rx.grouped_reducescatter([v], op=rx.Average)
    c.sum().backward()
    out["reducescatter_avg"] = v.grad
    rx.shutdown()
    return out


@pytest.mark.parametrize("size,shm", [(2, "1"), (3, "0")])
def test_gradients_through_every_collective_match_one_process(size, shm):
    results = run_workers(_gradients, size, env={"RAYTRAIN_X_SHM": shm}, work_s=20)
    everyone = torch.cat([_rows(k) for k in range(size)]).requires_grad_()
    _contrastive(everyone).backward()
    pair = [torch.cat([_rows(k) for k in range(size)]).requires_grad_(),
            torch.cat([_rows(k) * 2 for k in range(size)]).requires_grad_()]
    _contrastive(torch.cat(pair, dim=1)).backward()
    offsets = [sum(ROWS[:k]) for k in range(size)]
    for r, got in enumerate(results):
        rows = slice(offsets[r], offsets[r] + ROWS[r])
        # one process, the whole batch: the gradient of each rank's rows
        assert torch.allclose(got["allgather"], everyone.grad[rows])
        assert torch.allclose(got["grouped_allgather"][0], pair[0].grad[rows])
        assert torch.allclose(got["grouped_allgather"][1], pair[1].grad[rows])
        # d/dy of sum_k(0.5 * sum_r 2 y_r) . arange  = the weights, summed over the ranks
        assert torch.equal(got["allreduce_sum"], torch.arange(4.).double() * size)
        # Average's gradient is the average of the ranks' gradients: (1 + 2 * 3) each
        assert torch.allclose(got["grouped_allreduce"], torch.full((3,), 7.0).double())
        root_value = float(size - 1)
        want = torch.full((3,), 2 * root_value).double() if r == size - 1 else torch.zeros(3)
        assert torch.allclose(got["broadcast"], want.double())
        grad, received = got["alltoall"]
        assert received == [r + 1] * size
        # the rows rank r sent to rank k come back scaled by k + 1
        want = torch.cat([torch.full((k + 1, 2), float(k + 1)) for k in range(size)]).double()
        assert torch.equal(grad, want)
        assert torch.equal(got["reducescatter_sum"], torch.full((2 * size + 1, 2), size).double())
        assert torch.equal(got["reducescatter_avg"], torch.ones(2 * size, 3).double())
