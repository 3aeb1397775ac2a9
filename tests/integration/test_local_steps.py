"""LocalSGD and DiLoCo between real processes: each matches the algorithm computed in one
process (with and without the exchange overlapped), `synchronize()` after the last step
applies an exchange still on the wire, a newcomer takes the anchor at an elastic sync while
survivors keep their inner steps, and bad arguments get one clear error."""

from __future__ import annotations

import pytest
import torch

from tests.expect import error_messages
from tests.workers import run_workers

H, STEPS = 3, 8  # an exchange every 3 inner steps; 8 steps: two exchanges and a remainder


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def _local_step(model, opt, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _reducer(kind: str, overlap: int):
    import raytrain_x.torch as rx

    if kind == "localsgd":
        return rx.LocalSGD(sync_every=H, overlap_steps=overlap)
    return rx.DiLoCo(sync_every=H, outer_lr=0.7, outer_momentum=0.9, overlap_steps=overlap)


def _trained(kind: str, overlap: int) -> list[torch.Tensor]:
    import raytrain_x.torch as rx

    rx.init()
    model = _model()
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                                  named_parameters=model.named_parameters(),
                                  reducer=_reducer(kind, overlap))
    for step in range(STEPS):
        _local_step(model, opt, rx.rank(), step)
    rx.shutdown()
    return [p.detach().clone() for p in model.parameters()]


def _reference(kind: str, overlap: int, steps: int = STEPS,
               flush: bool = False) -> list[list[torch.Tensor]]:
    """The algorithm in one process: two models stepping on their own data, their exchange
    computed by hand (DiLoCo's outer optimizer: torch's SGD with Nesterov momentum); with
    `flush`, an exchange still pending after the last step is applied."""
    models = [_model() for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5) for m in models]
    params = [list(m.parameters()) for m in models]
    anchor = [p.detach().clone() for p in params[0]]
    outer = torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True)
    pending = None  # [age, sent per rank, the payloads' average]

    @torch.no_grad()
    def apply(sent, average) -> None:
        if kind == "diloco":
            for a, g in zip(anchor, average):
                a.grad = g
            outer.step()
            average = [a.clone() for a in anchor]
        for rank in range(2):  # the new model, plus what each rank did meanwhile
            for p, n, s in zip(params[rank], average, sent[rank]):
                p.copy_(n + (p - s))

    for step in range(steps):
        for rank in range(2):
            _local_step(models[rank], opts[rank], rank, step)
        if pending is not None:
            pending[0] += 1
            if pending[0] >= overlap:
                apply(*pending[1:])
                pending = None
        if (step + 1) % H == 0:
            sent = [[p.detach().clone() for p in ps] for ps in params]
            payload = ([[a - p for a, p in zip(anchor, ps)] for ps in sent]
                       if kind == "diloco" else sent)
            pending = [0, sent, [(a + b) / 2 for a, b in zip(*payload)]]
            if overlap == 0:
                apply(*pending[1:])
                pending = None
    if flush and pending is not None:
        apply(*pending[1:])
    return [[p.detach() for p in ps] for ps in params]


@pytest.mark.parametrize("kind", ["localsgd", "diloco"])
@pytest.mark.parametrize("overlap", [0, 1])
def test_matches_the_algorithm_computed_in_one_process(kind, overlap):
    results = run_workers(_trained, 2, kind, overlap)
    expected = _reference(kind, overlap)
    for rank in range(2):
        for got, want in zip(results[rank], expected[rank]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if overlap == 0:  # the last exchange left every rank on the same model, then 2 steps
        assert not all(torch.equal(a, b) for a, b in zip(*results))


def _flushed(kind: str, folder: str) -> tuple[list[torch.Tensor], int]:
    from pathlib import Path

    import raytrain_x.torch as rx
    from tests import limits

    rx.init()
    model = _model()
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                                  named_parameters=model.named_parameters(),
                                  reducer=_reducer(kind, 1))
    done = Path(folder) / "rank0_done"
    for step in range(2 * H):  # the last step sends an exchange the overlap leaves pending
        if rx.rank() == 1 and step == 2 * H - 1:  # rank 0 reaches the end first
            limits.wait_until(done.exists, 60, "rank 0 past its last step")
        _local_step(model, opt, rx.rank(), step)
    if rx.rank() == 0:
        done.touch()
    opt.synchronize()
    exchanges = opt.reducer.exchanges
    rx.shutdown()
    return [p.detach().clone() for p in model.parameters()], exchanges


@pytest.mark.parametrize("kind", ["localsgd", "diloco"])
def test_synchronize_after_the_last_step_applies_the_exchange_on_the_wire(kind, tmp_path):
    results = run_workers(_flushed, 2, kind, str(tmp_path))
    expected = _reference(kind, 1, steps=2 * H, flush=True)
    for rank in range(2):
        params, exchanges = results[rank]
        assert exchanges == 2
        for got, want in zip(params, expected[rank]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(results[0][0], results[1][0]):  # no step since: the same global model
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def _elastic_sync() -> dict:
    import tempfile

    import raytrain_x.torch as rx
    from raytrain_x.torch import durable
    from raytrain_x.torch.grad_sync import REDUCER_KEY

    rx.init()
    rank = rx.rank()
    model = _model()
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  reducer=rx.DiLoCo(sync_every=2))
    state = rx.elastic.TorchState(model, opt, batch=0)
    state.sync()
    for step in range(3):  # an outer step at 2, then one inner step on each rank's own data
        _local_step(model, opt, rank, step)
    state.commit()
    out = {"before": [p.detach().clone() for p in model.parameters()]}
    state.sync()  # a new round with both survivors: each keeps its inner steps
    out["kept"] = [p.detach().clone() for p in model.parameters()]
    _local_step(model, opt, rank, 3)  # not committed: a failure rolls it back, and a
    state.restore()                   # survivor goes on from its own last commit
    state.sync()
    out["restored"] = [p.detach().clone() for p in model.parameters()]
    if rank == 1:  # a newcomer in rank 1's place: a fresh model and optimizer
        torch.manual_seed(7)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                    torch.nn.Linear(8, 2))
        opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(),
                                      reducer=rx.DiLoCo(sync_every=2))
        state = rx.elastic.TorchState(model, opt, batch=0)
    state.sync()
    reducer = opt._reducer
    out["after_join"] = [p.detach().clone() for p in model.parameters()]
    out["anchor"] = [a.clone() for a in reducer._anchor]
    out["outer"], out["inner"] = reducer._outer, reducer._inner
    out["momentum"] = [s["momentum_buffer"].clone() for s in
                       reducer._outer_optimizer().state.values()]
    _local_step(model, opt, rank, 3)  # the next outer step: both ranks exchange together
    out["anchor_next"] = [a.clone() for a in reducer._anchor]
    with tempfile.TemporaryDirectory() as folder:  # the state as durable checkpoints keep it
        saved = opt.state_dict()
        durable.save({"optimizer": saved}, folder)
        loaded = durable.load(folder)["optimizer"][REDUCER_KEY]
        kept = saved[REDUCER_KEY]
        out["durable"] = (
            torch.equal(loaded["anchor"][0], kept["anchor"][0])
            and all(torch.equal(a["momentum_buffer"], b["momentum_buffer"])
                    for a, b in zip(loaded["outer_optimizer"]["state"].values(),
                                    kept["outer_optimizer"]["state"].values()))
            and (loaded["outer"], loaded["inner"]) == (kept["outer"], kept["inner"]))
    rx.shutdown()
    return out


def test_a_newcomer_takes_the_anchor_and_survivors_keep_their_inner_steps():
    r0, r1 = run_workers(_elastic_sync, 2)
    for r in (r0, r1):  # a survivor's parameters are its own after a sync
        for a, b, c in zip(r["before"], r["kept"], r["restored"]):
            assert torch.equal(a, b) and torch.equal(a, c)
    assert not all(torch.equal(a, b) for a, b in zip(r0["kept"], r1["kept"]))
    flat = torch.cat([p.reshape(-1) for p in r1["after_join"]])
    assert torch.equal(flat, r1["anchor"][0])  # the newcomer starts from the anchor
    assert all(torch.equal(a, b) for a, b in zip(r0["after_join"], r0["kept"]))
    assert (r0["outer"], r0["inner"]) == (r1["outer"], r1["inner"]) == (1, 1)
    for a, b in zip(r0["momentum"], r1["momentum"]):  # the outer optimizer's state too
        assert torch.equal(a, b)
    assert torch.equal(r0["anchor_next"][0], r1["anchor_next"][0])
    assert not torch.equal(r0["anchor_next"][0], r0["anchor"][0])
    assert r0["durable"] and r1["durable"]  # a durable checkpoint keeps the reducer's state


def _bad_arguments() -> list[str]:
    import raytrain_x.torch as rx
    from raytrain_x.common.errors import ConfigError

    rx.init()
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    shared = rx.LocalSGD(2)
    first = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    reducer=shared)
    errors = error_messages(
        ConfigError,
        lambda: rx.LocalSGD(sync_every=0),
        lambda: rx.DiLoCo(sync_every=4, overlap_steps=4),
        lambda: rx.DiLoCo(sync_every=4, outer_momentum=1.0),
        lambda: rx.DistributedOptimizer(sgd, reducer=rx.LocalSGD(2), zero_stage=1),
        lambda: rx.DistributedOptimizer(sgd, reducer=rx.DiLoCo(2), op=rx.Adasum),
        lambda: rx.DistributedOptimizer(sgd, reducer="diloco"),
        lambda: rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        reducer=shared))
    del first
    rx.shutdown()
    return errors


def test_bad_arguments_get_one_clear_error():
    errors = run_workers(_bad_arguments, 1)[0]
    assert "no error" not in errors, errors
    assert "sync_every must be an int >= 1" in errors[0]
    assert "overlap_steps must be an int in [0, sync_every)" in errors[1]
    assert "outer_momentum must be in [0, 1)" in errors[2]
    assert "leave out zero_stage" in errors[3]
    assert "leave out op=rx.Adasum" in errors[4]
    assert "reducer must be an rx.Reducer" in errors[5]
    assert "make one per DistributedOptimizer" in errors[6]
