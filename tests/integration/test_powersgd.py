"""PowerSGD between real processes: at full rank it is the exact average (the same model
as the default allreduce's), at low rank it follows the algorithm computed in one process
(torch's PowerSGD hook's steps: error feedback, warm start, whole vectors averaged), the
first `start_iter` steps are plain averages, a new world draws its Qs again, and bad
arguments get one clear error."""

from __future__ import annotations

import torch

from tests.expect import error_messages
from tests.workers import run_workers

STEPS = 6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 10), torch.nn.Tanh(),
                               torch.nn.Linear(10, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 12, generator=g), torch.randn(8, 3, generator=g)


def _loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = _batch(rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def _trained(reducer_args: dict | None, steps: int = STEPS,
             reinit_at: int | None = None) -> list[torch.Tensor]:
    import raytrain_x.torch as rx

    rx.init()
    model = _model()
    reducer = None if reducer_args is None else rx.PowerSGD(**reducer_args)
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                                  named_parameters=model.named_parameters(), reducer=reducer)
    for step in range(steps):
        if step == reinit_at:  # a new world, as after an elastic change
            rx.shutdown()
            rx.init()
        opt.zero_grad()
        _loss(model, rx.rank(), step).backward()
        opt.step()
    rx.shutdown()
    return [p.detach().clone() for p in model.parameters()]


def _reference(rank: int, error_feedback: bool, start_iter: int,
               reinit_at: int | None = None) -> list[list[torch.Tensor]]:
    """PowerSGD for 2 ranks computed in one process, as torch's hook computes it: per
    matrix gradient M_i (plus its error), P = sum_i M_i Q, orthonormalised; Q = sum_i
    M_i^T P; every rank's gradient P Q^T / 2; vectors averaged whole; the error is what a
    rank sent minus what it got. Qs are drawn as the reducer draws them (QR here, whose
    signs may differ from Gram-Schmidt's: P Q^T does not depend on them)."""
    from raytrain_x.torch.powersgd import compressed_shape

    models = [_model(), _model()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5) for m in models]
    params = [list(m.parameters()) for m in models]
    order = list(reversed(range(len(params[0]))))  # a bucket holds them in reverse order
    shapes = {i: compressed_shape(params[0][i], rank, 2.0) for i in order}
    errors: list[dict[int, torch.Tensor]] = [{}, {}]
    qs: dict[int, torch.Tensor] = {}

    def draw(iteration: int) -> None:
        g = torch.Generator().manual_seed(iteration)
        total = sum(shapes[i][1] * shapes[i][2] for i in order if shapes[i])
        flat = torch.randn(total, generator=g, dtype=torch.float64).float()
        at = 0
        for i in order:
            if shapes[i]:
                _, m, r = shapes[i]
                qs[i] = torch.linalg.qr(flat[at:at + m * r].view(m, r))[0]
                at += m * r

    for step in range(STEPS):
        if step == 0 or step == reinit_at:
            draw(step)
            errors = [{}, {}]
        for r in (0, 1):
            opts[r].zero_grad()
            _loss(models[r], r, step).backward()
        grads = [[p.grad.clone() for p in params[r]] for r in (0, 1)]
        for i in order:
            if step < start_iter:
                avg = (grads[0][i] + grads[1][i]) / 2
                outs = [avg, avg]
            else:
                sent = [grads[r][i] + errors[r].get(i, 0) if error_feedback else grads[r][i]
                        for r in (0, 1)]
                if shapes[i] is None:
                    avg = (sent[0] + sent[1]) / 2
                    outs = [avg, avg]
                else:
                    n, m, _ = shapes[i]
                    ms = [s.view(n, m) for s in sent]
                    p_ = torch.linalg.qr(ms[0] @ qs[i] + ms[1] @ qs[i])[0]
                    qs[i] = ms[0].T @ p_ + ms[1].T @ p_
                    approx = (p_ @ qs[i].T / 2).view_as(sent[0])
                    outs = [approx, approx]
                for r in (0, 1):
                    errors[r][i] = sent[r] - outs[r]
            for r in (0, 1):
                params[r][i].grad.copy_(outs[r])
        for r in (0, 1):
            opts[r].step()
    return [[p.detach() for p in params[r]] for r in (0, 1)]


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, atol=1e-5, rtol=1e-4) for x, y in zip(a, b))


def _full_rank_and_plain() -> dict:
    full = _trained({"matrix_rank": 16, "start_iter": 0, "min_compression_rate": 1e-3})
    plain = _trained(None)
    return {"full": full, "plain": plain}


def test_at_full_rank_it_is_the_exact_average_of_the_default_allreduce():
    results = run_workers(_full_rank_and_plain, 2)
    for r in results:
        assert _close(r["full"], r["plain"])
    assert _close(results[0]["full"], results[1]["full"])


def _low_rank_ways() -> dict:
    return {
        "feedback": _trained({"matrix_rank": 2, "start_iter": 2, "seed": 0}),
        "no feedback": _trained({"matrix_rank": 2, "start_iter": 0, "error_feedback": False}),
        "new world": _trained({"matrix_rank": 2, "start_iter": 0}, reinit_at=3),
    }


def test_at_low_rank_it_follows_the_algorithm_with_error_feedback_and_a_new_world():
    results = run_workers(_low_rank_ways, 2)
    expected = {
        "feedback": _reference(2, error_feedback=True, start_iter=2),
        "no feedback": _reference(2, error_feedback=False, start_iter=0),
        # a new world starts with no error and Qs drawn again at that step
        "new world": _reference(2, error_feedback=True, start_iter=0, reinit_at=3),
    }
    for way, want in expected.items():
        for rank in (0, 1):
            assert _close(results[rank][way], want[rank]), way
    plain = _reference(64, error_feedback=True, start_iter=STEPS)  # every step averaged
    assert not _close(results[0]["feedback"], plain[0])  # it did compress


def _bad_arguments() -> list[str]:
    import raytrain_x.torch as rx
    from raytrain_x.common.errors import ConfigError

    rx.init()
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    errors = error_messages(
        ConfigError,
        lambda: rx.PowerSGD(matrix_rank=0),
        lambda: rx.PowerSGD(start_iter=-1),
        lambda: rx.PowerSGD(bucket_cap_mb=0),
        lambda: rx.DistributedOptimizer(sgd, reducer=rx.PowerSGD(),
                                        compression=rx.Compression.fp16),
        lambda: rx.DistributedOptimizer(sgd, reducer=rx.PowerSGD(), groups=2))
    rx.shutdown()
    return errors


def test_bad_arguments_get_one_clear_error():
    errors = run_workers(_bad_arguments, 1)[0]
    assert "no error" not in errors, errors
    assert "matrix_rank must be an int >= 1" in errors[0]
    assert "start_iter must be an int >= 0" in errors[1]
    assert "bucket_cap_mb must be > 0" in errors[2]
    assert "leave out compression" in errors[3]
    assert "leave out groups" in errors[4]
