"""Adasum between real processes: the engine's vector-halving, distance-doubling Adasum
equals a direct binary tree of the pairwise formula, fused or not, on 2 and 4 ranks, for
gradients of any scale float32 holds; other world sizes get a clear error;
DistributedOptimizer(op=Adasum) trains."""

from __future__ import annotations

import pytest
import torch

from tests.workers import run_workers

SHAPES = [(7,), (3, 5), (1,), (64,)]
TINY = 1e-36  # float32 gradients this small have squared norms near 1e-70

def _vectors(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    # partly shared direction, partly rank-own: neither parallel nor orthogonal
    return [torch.randn(*s, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
            + torch.randn(*s, generator=g, dtype=torch.float64) * (rank + 1) for s in SHAPES]


def _pairwise(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The formula of Maleki et al., written out directly."""
    dot = float((a * b).sum())
    ca = 1 - dot / (2 * float((a * a).sum())) if float((a * a).sum()) else 1.0
    cb = 1 - dot / (2 * float((b * b).sum())) if float((b * b).sum()) else 1.0
    return ca * a + cb * b


def _tree(vectors: list[torch.Tensor]) -> torch.Tensor:
    while len(vectors) > 1:
        vectors = [_pairwise(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
    return vectors[0]


def _adasum() -> dict:
    import raytrain_x.torch as rx

    rx.init()
    mine = _vectors(rx.rank())
    alone = [rx.allreduce(t, op=rx.Adasum, name=f"alone{i}") for i, t in enumerate(mine)]
    fused = rx.grouped_allreduce([t.float() for t in mine], op=rx.Adasum, name="fused")
    tiny = rx.allreduce((mine[3] * TINY).float(), op=rx.Adasum, name="tiny")
    rx.shutdown()
    return {"alone": alone, "fused": fused, "tiny": tiny}


@pytest.mark.parametrize("size", [2, 4])
def test_adasum_equals_the_pairwise_tree(size):
    results = run_workers(_adasum, size, work_s=15)
    everyone = [_vectors(r) for r in range(size)]
    for i in range(len(SHAPES)):
        want = _tree([v[i] for v in everyone])
        for got in results:
            assert torch.allclose(got["alone"][i], want, atol=1e-12)
            assert got["fused"][i].dtype == torch.float32
            assert torch.allclose(got["fused"][i], want.float(), atol=1e-5)
    # the Adasum combination, not the sum: tiny norms are not taken for zero
    want = _tree([v[3] * TINY for v in everyone]).float()
    for got in results:
        assert torch.allclose(got["tiny"], want, rtol=1e-4, atol=0)


def _three_ranks() -> str:
    import raytrain_x.torch as rx

    rx.init()
    try:
        rx.allreduce(torch.ones(3), op=rx.Adasum)
    except rx.ConfigError as exc:
        return str(exc)
    finally:
        rx.shutdown()
    return "no error"


def test_adasum_on_three_ranks_is_refused_clearly():
    for text in run_workers(_three_ranks, 3, work_s=10):
        assert "power-of-two number of ranks" in text and "got 3" in text
