"""Horovod's DistributedOptimizer arguments between real processes: groups/num_groups,
sparse embeddings both ways, set_backward_passes_per_step, op=Adasum, Horovod's positional
order."""

from __future__ import annotations

import torch

from tests.workers import run_workers


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def _train(model, opt, rank: int, steps: int = 3) -> None:
    x, y = _data(rank)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _groups() -> dict:
    import raytrain_x.torch as rx

    rx.init()
    out = {}
    for key, kwargs in [("default", {}), ("groups=2", {"groups": 2}),
                        ("num_groups=3", {"num_groups": 3}), ("lists", "lists")]:
        model = _model()
        if kwargs == "lists":
            kwargs = {"groups": [[model[0].weight, model[2].bias]]}
        opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(), **kwargs)
        _train(model, opt, rx.rank())
        out[key] = [p.detach().clone() for p in model.parameters()]
    # Horovod's positional order: optimizer, named_parameters, compression,
    # backward_passes_per_step, op, gradient_predivide_factor, num_groups, groups,
    # sparse_as_dense, process_set
    model = _model()
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters(), rx.Compression.none, 1, rx.Average,
                                  1.0, 0, 2, False, rx.global_process_set)
    _train(model, opt, rx.rank())
    out["positional"] = [p.detach().clone() for p in model.parameters()]
    # accumulation changed on the fly: two backward passes per step, then one again
    model = _model()
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.set_backward_passes_per_step(2)
    x, y = _data(rx.rank())
    opt.zero_grad()
    for _ in range(2):
        torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.set_backward_passes_per_step(1)
    _train(model, opt, rx.rank(), steps=1)
    out["accumulated"] = [p.detach().clone() for p in model.parameters()]
    rx.shutdown()
    return out


def _single(accumulated: bool = False) -> list[torch.Tensor]:
    """One process, the averaged gradient of both ranks' losses."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [_data(r) for r in range(2)]
    for step in range(2 if accumulated else 3):
        opt.zero_grad()
        passes = 2 if accumulated and step == 0 else 1
        loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in data) / 2 * passes
        loss.backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_groups_positional_order_and_changed_accumulation_keep_the_result():
    results = run_workers(_groups, 2, work_s=15)
    want = _single()
    for got in results:
        for key in ("default", "groups=2", "num_groups=3", "lists", "positional"):
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got[key], want)), key
        assert all(torch.allclose(a, b, atol=1e-6)
                   for a, b in zip(got["accumulated"], _single(accumulated=True)))


class _Embedder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embedding = torch.nn.Embedding(10, 3, sparse=True)
        self.head = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.head(self.embedding(x)).sum()


INPUTS = [torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9]]), torch.tensor([[1, 3, 4], [4, 7, 9]])]


def _sparse() -> dict:
    import raytrain_x.torch as rx

    rx.init()
    out = {}
    for dense in (False, True):
        model = _Embedder()
        sparse_opt = rx.DistributedOptimizer(torch.optim.SparseAdam(
            list(model.embedding.parameters()), lr=0.1), sparse_as_dense=dense)
        dense_opt = rx.DistributedOptimizer(torch.optim.SGD(model.head.parameters(), lr=0.1))
        for _ in range(2):
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
            model(INPUTS[rx.rank()]).backward()
            assert model.embedding.weight.grad.is_sparse
            sparse_opt.step()
            dense_opt.step()
        out[dense] = model.embedding.weight.detach().clone()
    rx.shutdown()
    return out


def test_sparse_embeddings_train_as_sparse_and_as_dense():
    results = run_workers(_sparse, 2, work_s=15)
    model = _Embedder()
    sparse_opt = torch.optim.SparseAdam(list(model.embedding.parameters()), lr=0.1)
    dense_opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    for _ in range(2):
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        (sum(model(x) for x in INPUTS) / 2).backward()
        sparse_opt.step()
        dense_opt.step()
    for got in results:
        for dense in (False, True):
            assert torch.allclose(got[dense], model.embedding.weight, atol=1e-6), dense


def _one_optimizer_over_sparse_and_dense() -> dict:
    import raytrain_x.torch as rx

    rx.init()
    out = {}
    for dense in (False, True):
        model = _Embedder()  # the sparse embedding is registered first: last in the arena
        opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(),
                                      sparse_as_dense=dense)
        for _ in range(2):
            opt.zero_grad()
            model(INPUTS[rx.rank()]).backward()
            opt.step()
        out[dense] = [p.detach().clone() for p in model.parameters()]
    rx.shutdown()
    return out


def test_one_optimizer_takes_a_sparse_embedding_among_dense_layers():
    # the sparse gradient leaves the flat buffer its dense neighbours stay in
    results = run_workers(_one_optimizer_over_sparse_and_dense, 2, work_s=15)
    model = _Embedder()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        (sum(model(x) for x in INPUTS) / 2).backward()
        opt.step()
    for got in results:
        for dense in (False, True):
            assert all(torch.allclose(a, b, atol=1e-6)
                       for a, b in zip(got[dense], model.parameters())), dense


def _adasum_step() -> dict:
    import raytrain_x.torch as rx

    rx.init()
    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), op=rx.Adasum)
    x, y = _data(rx.rank())
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    opt.step()
    after_one = [p.detach().clone() for p in model.parameters()]
    losses = []
    for _ in range(40):  # and it trains
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(rx.allreduce(loss.detach(), name="loss")))
    rx.shutdown()
    return {"start": start, "grads": grads, "after_one": after_one, "losses": losses}


def test_adasum_optimizer_combines_the_local_steps_and_trains():
    from tests.integration.test_adasum import _pairwise

    results = run_workers(_adasum_step, 2, work_s=15)
    for i, start in enumerate(results[0]["start"]):
        deltas = [-0.1 * r["grads"][i] for r in results]  # SGD's local steps
        want = start + _pairwise(deltas[0].double(), deltas[1].double()).float()
        for r in results:
            assert torch.allclose(r["after_one"][i], want, atol=1e-6)
    losses = results[0]["losses"]
    assert losses[-1] < 0.7 * losses[0]
    assert results[0]["after_one"][0].equal(results[1]["after_one"][0])
