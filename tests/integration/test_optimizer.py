"""DistributedOptimizer trains to the same weights as one process on the combined batch."""

from __future__ import annotations

import pytest
import torch

from tests.workers import run_workers


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _data(steps: int, batch: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 8, generator=g), torch.randint(0, 3, (batch,), generator=g))
            for _ in range(steps)]


def _distributed(steps: int, batch: int, opt_name: str, compression: str, passes: int) -> dict:
    import raytrain_x.torch as rx

    rx.init()
    model = _model()
    if rx.rank() == 0:  # start from different weights on purpose; broadcast must fix it
        pass
    else:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    base = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if opt_name == "sgd"
            else torch.optim.Adam(model.parameters(), lr=0.01))
    opt = rx.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                  compression=getattr(rx.Compression, compression),
                                  backward_passes_per_step=passes)
    assert isinstance(opt, type(base))
    rx.broadcast_parameters(model.state_dict(), root_rank=0)
    rx.broadcast_optimizer_state(opt, root_rank=0)
    n, r = rx.size(), rx.rank()
    for x, y in _data(steps, batch):
        shard = slice(r * batch // n, (r + 1) * batch // n)
        xs, ys = x[shard], y[shard]
        opt.zero_grad()
        chunk = len(xs) // passes
        for k in range(passes):
            part = slice(k * chunk, (k + 1) * chunk)
            loss = torch.nn.functional.cross_entropy(model(xs[part]), ys[part]) / passes
            loss.backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _single(steps: int, batch: int, opt_name: str, make_model=_model) -> dict:
    model = make_model()
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if opt_name == "sgd"
           else torch.optim.Adam(model.parameters(), lr=0.01))
    for x, y in _data(steps, batch):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize(
    "size,opt_name,compression,passes,tol",
    [(2, "sgd", "none", 1, 1e-5), (3, "adam", "none", 1, 1e-5), (2, "sgd", "none", 2, 1e-5),
     (2, "sgd", "fp16", 1, 2e-2)],
)
def test_matches_single_process_training(size, opt_name, compression, passes, tol):
    steps, batch = 8, 24
    results = run_workers(_distributed, size, steps, batch, opt_name, compression, passes)
    reference = _single(steps, batch, opt_name)
    for state in results:
        for key, value in reference.items():
            assert torch.allclose(state[key], value, atol=tol, rtol=tol), key
    for key in reference:  # every rank ends bit-identical
        assert all(torch.equal(results[0][key], s[key]) for s in results[1:])


def _peer_dies_mid_step() -> str:
    import os
    import time

    import raytrain_x.torch as rx

    rx.init()
    model = torch.nn.Linear(64, 64)
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    if rx.rank() == 1:
        os._exit(1)  # dies between steps; rank 0's next step fails mid-flight
    time.sleep(0.5)
    try:  # the failure surfaces in backward (hooks) or in step, whichever comes first
        model(torch.ones(2, 64)).sum().backward()
        opt.step()
    except rx.InternalError:
        pass
    opt.zero_grad()  # an elastic reset must be able to go on: no stale handles
    return "ok"


def test_failed_step_leaves_no_stale_handles():
    results = run_workers(_peer_dies_mid_step, 2, allow_failures=True, work_s=15)
    assert results[0] == "ok"


def _views_of_buckets(opt, model) -> bool:
    """Every gradient lies inside one of the optimizer's float32 bucket buffers."""
    spans = [(b.flat.data_ptr(), b.flat.data_ptr() + b.flat.numel() * 4)
             for b in opt._reducer.layout.buckets]
    return all(p.grad is not None and any(lo <= p.grad.data_ptr() < hi for lo, hi in spans)
               for p in model.parameters())


def _bucketed(cap: float) -> dict:
    import raytrain_x.torch as rx

    rx.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 300), torch.nn.Tanh(), torch.nn.Linear(300, 3))
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), bucket_cap_mb=cap)
    views = []
    for x, y in _data(4, 12):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rx.rank()::2]), y[rx.rank()::2]).backward()
        opt.step()
        views.append(_views_of_buckets(opt, model) if cap else True)
    return {"state": {k: v.clone() for k, v in model.state_dict().items()},
            "buckets": len(opt._reducer.layout.buckets), "views": all(views)}


def test_bucketed_gradients_are_views_and_match_unbucketed():
    bucketed = run_workers(_bucketed, 2, 0.004)  # ~4 KB: several buckets
    plain = run_workers(_bucketed, 2, 0.0)
    assert bucketed[0]["buckets"] >= 2 and bucketed[0]["views"]
    assert plain[0]["buckets"] == 0
    for key, value in plain[0]["state"].items():
        assert torch.allclose(bucketed[0]["state"][key], value, atol=1e-6)
        assert torch.equal(bucketed[0]["state"][key], bucketed[1]["state"][key])


def _zero_grad_each_way() -> list[dict]:
    """Per step: the gradients after `zero_grad()` (None, or zeros with set_to_none=False),
    then after backward (this step's average, in the arena), with a layer left out of
    every other backward."""
    import raytrain_x.torch as rx

    rx.init()
    torch.manual_seed(0)
    used, skipped = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    named = [*(("used." + n, p) for n, p in used.named_parameters()),
             *(("skipped." + n, p) for n, p in skipped.named_parameters())]
    params = [p for _, p in named]
    opt = rx.DistributedOptimizer(torch.optim.SGD(params, lr=0.0), named_parameters=named)
    x = torch.full((2, 4), float(rx.rank() + 1))  # weight gradients 2 and 4: average 3
    steps = []
    for step in range(5):
        to_none = step != 2
        opt.zero_grad(set_to_none=to_none)
        cleared = all(p.grad is None if to_none else not p.grad.any() for p in params)
        loss = used(x).sum() + (skipped(x).sum() if step % 2 == 0 else 0.0)
        loss.backward()
        opt.step()
        spans = [(a.flat.data_ptr(), a.flat.data_ptr() + a.flat.numel() * 4)
                 for a in opt._reducer.layout.arenas]
        steps.append({
            "cleared": cleared,
            "in_arena": all(any(lo <= p.grad.data_ptr() < hi for lo, hi in spans)
                            for p in params),
            "used": [float(used.weight.grad.unique()), float(used.bias.grad.unique())],
            "skipped": [float(skipped.weight.grad.unique()),
                        float(skipped.bias.grad.unique())],
        })
    return steps


def test_zero_grad_clears_and_backward_refills_the_arena():
    # zero_grad() sets the arena's gradients to None, as torch's does, and each finds its
    # view again, zeroed, as backward brings it (set_to_none=False: zeros in place); a
    # gradient that does not come is reduced as zeros, also in its view
    for steps in run_workers(_zero_grad_each_way, 2):
        for i, step in enumerate(steps):
            assert step["cleared"] and step["in_arena"], i
            assert step["used"] == [3.0, 2.0], i  # this step's only: nothing left to add to
            assert step["skipped"] == ([3.0, 2.0] if i % 2 == 0 else [0.0, 0.0]), i


# Bucket sizes rank 0 switches to mid-training: several buckets, every gradient alone, one.
SWITCHES = {2: 4096, 5: 0, 8: 64 << 20}


def _deep_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32),
                               torch.nn.Tanh(), torch.nn.Linear(32, 3))


def _wide_model() -> torch.nn.Module:
    """Gradients in two runs of the arena: the first closes with the middle weight (1.4
    MB), the first layer's gradients are the second."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 600), torch.nn.Tanh(),
                               torch.nn.Linear(600, 600), torch.nn.Tanh(),
                               torch.nn.Linear(600, 3))


def _views_of_arenas(opt, model) -> bool:
    """Every gradient lies inside one of the optimizer's arenas (so runs fused in a batch
    are back to back)."""
    laid = [p for arena in opt._reducer.layout.arenas for p in arena.params]
    spans = [(a.flat.data_ptr(), a.flat.data_ptr() + a.flat.numel() * 4)
             for a in opt._reducer.layout.arenas]
    return (sorted(map(id, laid)) == sorted(id(p) for p in model.parameters())
            and all(any(lo <= p.grad.data_ptr() < hi for lo, hi in spans)
                    for p in model.parameters()))


def _across_switches(steps: int, batch: int) -> dict:
    import raytrain_x.torch as rx
    from raytrain_x import Knobs
    from raytrain_x.core import runtime

    rx.init(knobs=Knobs(fusion_threshold_bytes=64 << 20, cycle_time_ms=0.5))
    stats = runtime.engine().stats
    model = _wide_model()
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters())
    n, r = rx.size(), rx.rank()
    kept, views, cuts = True, True, []
    for i, (x, y) in enumerate(_data(steps, batch)):
        if r == 0 and i in SWITCHES:
            rx.set_knobs(rx.knobs().replace(fusion_threshold_bytes=SWITCHES[i]))
        shard = slice(r * batch // n, (r + 1) * batch // n)
        if i % 2:
            model.zero_grad()  # gradients set to None: they must find their arena again
        else:
            opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[shard]), y[shard]).backward()
        opt.synchronize()
        grads = [p.grad.clone() for p in model.parameters()]
        with opt.skip_synchronize():
            opt.step()
        cuts.append((opt._reducer.layout.unit_bytes,
                     [unit.name for unit in opt._reducer.layout.units]))
        kept = kept and all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
        views = views and _views_of_arenas(opt, model)
    return {"state": {k: v.clone() for k, v in model.state_dict().items()},
            "cuts": cuts, "fused": stats.fused, "pieces": stats.in_flight_pieces,
            "kept": kept, "views": views}


def test_units_cross_as_formed_and_are_cut_again_at_the_same_step_on_every_rank():
    steps, batch = 12, 24
    # over gloo, as between hosts: a unit of 1 MB or more crosses on the in-flight route
    results = run_workers(_across_switches, 3, steps, batch, env={"RAYTRAIN_X_SHM": "0"})
    assert all(r["kept"] and r["views"] for r in results)
    cuts = results[0]["cuts"]
    # every rank cut its runs again at the same step: the same units, step by step
    assert all(r["cuts"] == cuts for r in results[1:])
    # reverse registration order; the first run closes once it holds 1 MB
    assert cuts[0][1] == ["grad.4.bias..2.weight", "grad.0.bias..0.weight"]
    # each threshold rank 0 set was followed (at the step after the change was agreed)
    assert {unit_bytes for unit_bytes, _ in cuts} == {64 << 20, 4096, 0}
    assert ["grad.4.bias", "grad.4.weight", "grad.2.bias", "grad.2.weight", "grad.0.bias",
            "grad.0.weight"] in [names for unit_bytes, names in cuts if unit_bytes == 0]
    # the engine fused no unit with another and cut none in pieces: in every cut, one unit
    # a step is of 1 MB or more (the middle weight, alone or in its run), one piece
    assert all(r["fused"] == 0 and r["pieces"] == steps for r in results)
    reference = _single(steps, batch, "sgd", _wide_model)
    for key, value in reference.items():
        assert torch.allclose(results[0]["state"][key], value, atol=1e-5, rtol=1e-5), key
        assert all(torch.equal(results[0]["state"][key], r["state"][key]) for r in results[1:])


def _fixed_bucket() -> dict:
    import raytrain_x.torch as rx
    from raytrain_x import Knobs

    rx.init(knobs=Knobs(fusion_threshold_bytes=64 << 20))
    model = torch.nn.Linear(16, 16)
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), bucket_cap_mb=0.001)
    for i in range(6):
        if rx.rank() == 0 and i == 1:
            rx.set_knobs(rx.knobs().replace(fusion_threshold_bytes=0))
        opt.zero_grad()
        model(torch.ones(2, 16)).sum().backward()
        opt.step()
    return {"cap": opt.bucket_cap_bytes, "threshold": rx.knobs().fusion_threshold_bytes}


def test_a_user_fixed_bucket_size_ignores_the_knob():
    results = run_workers(_fixed_bucket, 2)
    assert all(r["threshold"] == 0 for r in results)  # the knob did change ...
    assert all(r["cap"] == 1048 for r in results)  # ... the buckets did not


def _dropped_optimizer_is_freed() -> bool:
    import gc
    import weakref

    import raytrain_x.torch as rx

    rx.init()
    model = _deep_model()
    gc.disable()  # freed by reference counting alone, not whenever the collector runs
    try:
        opt = rx.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                      named_parameters=model.named_parameters())
        opt.zero_grad()
        model(torch.ones(4, 8)).sum().backward()
        opt.step()
        ref = weakref.ref(opt)
        del opt
        freed = ref() is None
        model(torch.ones(4, 8)).sum().backward()  # the model's hooks outlive it: harmless
    finally:
        gc.enable()
    rx.shutdown()
    return freed


def test_a_dropped_optimizer_frees_its_buffers_at_once():
    # Its parameters' hooks hold it weakly: a strong reference made a cycle that kept each
    # dropped GPT optimizer's 360 MB until the collector ran (a benchmark ran out of memory)
    assert run_workers(_dropped_optimizer_is_freed, 2) == [True, True]


def _built_after_a_peer_died() -> str:
    import os

    import raytrain_x.torch as rx

    rx.init()
    rx.allreduce(torch.ones(3), name="warm")
    if rx.rank() == 1:
        os._exit(1)  # a real crash: no shutdown, sockets close
    try:
        rx.allreduce(torch.ones(3), name="after-crash")
    except rx.InternalError:
        pass  # the engine has failed
    model = _deep_model()
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())  # no raise
    try:
        model(torch.ones(4, 8)).sum().backward()
        opt.step()
    except rx.InternalError as exc:
        return f"the step: {exc}"
    return "no error"


def test_a_failed_worlds_error_belongs_to_the_step_not_the_optimizers_construction():
    # an elastic job builds its optimizer before `run` catches the world's failures
    results = run_workers(_built_after_a_peer_died, 2, allow_failures=True, work_s=15)
    assert results[0].startswith("the step: ") and "peer" in results[0]


def _data_parallel(steps: int, batch: int, accumulate: bool) -> dict:
    """DDP's usage with raytrain-x's `DataParallel`: a plain torch optimizer steps on the
    gradients backward averaged; with `accumulate`, half of each step's batch goes through
    a backward under `no_sync()`."""
    import raytrain_x.torch as rx
    from raytrain_x.torch.data_parallel import DataParallel, WorldSampler

    rx.init()
    inner = _model()
    if rx.rank() == 1:  # rank 0's weights reach every rank at construction, as with DDP
        with torch.no_grad():
            for p in inner.parameters():
                p.add_(1.0)
    model = DataParallel(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    n, r = rx.size(), rx.rank()
    for x, y in _data(steps, batch):
        xs, ys = x[r * batch // n:(r + 1) * batch // n], y[r * batch // n:(r + 1) * batch // n]
        opt.zero_grad()
        if accumulate:
            half = len(xs) // 2
            with model.no_sync():
                (torch.nn.functional.cross_entropy(model(xs[:half]), ys[:half]) / 2).backward()
            (torch.nn.functional.cross_entropy(model(xs[half:]), ys[half:]) / 2).backward()
        else:
            torch.nn.functional.cross_entropy(model(xs), ys).backward()
        opt.step()
    sampler = WorldSampler(list(range(10)), shuffle=False)
    return {"state": {k: v.clone() for k, v in model.module.state_dict().items()},
            "keys": sorted(model.state_dict()), "shard": list(sampler)}


@pytest.mark.parametrize("accumulate", [False, True])
def test_data_parallel_trains_as_ddp_with_a_plain_optimizer(accumulate):
    """`DataParallel` (what `ray.train.torch.prepare_model` builds in an elastic run) gives
    a plain torch optimizer the gradients averaged by the end of backward, as DDP does: the
    ranks train to the weights of one process on the combined batch."""
    steps, batch = 6, 24
    results = run_workers(_data_parallel, 2, steps, batch, accumulate)
    reference = _single(steps, batch, "sgd")
    for out in results:
        for key, value in reference.items():
            assert torch.allclose(out["state"][key], value, atol=1e-5, rtol=1e-5), key
        assert all(k.startswith("module.") for k in out["keys"])  # DDP's state dict keys
    assert [out["shard"] for out in results] == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
