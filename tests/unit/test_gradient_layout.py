"""`DistributedOptimizer`'s gradient layout without processes: the arena's runs (how they
are cut at the fusion threshold, named, laid and cut again), and a sparse gradient
leaving its run."""

from __future__ import annotations

import torch

from raytrain_x.torch.gradient_layout import (
    FIRST_RUN_BYTES,
    MIN_RUNS,
    GradientLayout,
    GradientRun,
    arena_runs,
)

MB = 1 << 20


def _params(*nbytes: int) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(n // 4)) for n in nbytes]


def _sizes(runs: list[list[torch.Tensor]]) -> list[int]:
    return [sum(p.numel() * 4 for p in run) for run in runs]


def test_runs_are_cut_as_ddp_cuts_buckets_at_the_fusion_threshold():
    # the first run closes once it holds 1 MB, the others once they hold the threshold
    params = _params(4096, 8 * MB, *[3 * MB] * 32, *[MB] * 8, 512 * 1024)  # 112.5 MB
    runs = arena_runs(params, 4 * MB)
    assert _sizes(runs) == [4096 + 8 * MB, *[6 * MB] * 16, *[4 * MB] * 2, 512 * 1024]
    assert [p for run in runs for p in run] == params  # in order, each once
    assert FIRST_RUN_BYTES == MB
    # a sixteenth of the arena (7 MB) is below a 64 MB threshold: it closes the runs
    total = sum(_sizes([params]))
    assert MIN_RUNS == 16
    runs = arena_runs(params, 64 * MB)
    assert all(total // 16 <= size < total // 16 + 3 * MB for size in _sizes(runs)[1:-1])
    assert len(runs) == 13 and [p for run in runs for p in run] == params


def test_a_small_arena_is_cut_in_runs_of_a_megabyte():
    runs = arena_runs(_params(*[MB // 2] * 16), 64 * MB)  # 8 MB
    assert _sizes(runs) == [MB] * 8
    assert len(arena_runs(_params(*[1024] * 100), 64 * MB)) == 1  # 100 KB: one run


def test_a_threshold_below_a_megabyte_cuts_the_first_run_too_and_zero_fuses_nothing():
    params = _params(*[256 * 1024] * 8)
    assert _sizes(arena_runs(params, MB // 2)) == [MB // 2] * 4
    assert arena_runs(params, 0) == [[p] for p in params]


def test_runs_are_cut_again_in_place_when_the_threshold_changes():
    params = _params(*[MB] * 32)
    built = GradientLayout(params, {p: f"p{i}" for i, p in enumerate(params)}, None)
    built.build(0, 64 * MB)
    assert _sizes([u.params for u in built.units]) == [MB, *[2 * MB] * 15, MB]
    views = {p: p.grad for p in params}
    built.cut(MB)
    assert _sizes([u.params for u in built.units]) == [MB] * 32 and built.unit_bytes == MB
    assert all(p.grad is views[p] for p in params)  # nothing moved: runs are views
    assert [u.name for u in built.units] == [f"grad.p{i}" for i in range(31, -1, -1)]


def test_runs_follow_the_registration_order_alone():
    # every rank (and a worker that joins later) cuts the same runs with the same names
    def layout():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 600), torch.nn.Linear(600, 600),
                                    torch.nn.Linear(600, 3))
        params = list(model.parameters())
        names = {p: n for n, p in model.named_parameters()}
        built = GradientLayout(params, names, None)
        built.build(0, 64 * MB)
        return built

    a, b = layout(), layout()
    assert [u.name for u in a.units] == [u.name for u in b.units] == [
        "grad.2.bias..1.weight", "grad.0.bias..0.weight"]
    assert all(isinstance(u, GradientRun) for u in a.units)
    arena = a.arenas[0]
    # each run is a stretch of the arena, back to back with the next, gradients as views
    first, second = a.units
    assert first.flat.data_ptr() == arena.flat.data_ptr()
    assert second.flat.data_ptr() == first.flat.data_ptr() + first.flat.numel() * 4
    assert first.flat.numel() + second.flat.numel() == arena.flat.numel()
    for unit in a.units:
        for p in unit.params:
            assert p.grad is arena.views[p]


def test_buckets_are_the_units_of_a_fixed_layout():
    params = _params(*[MB] * 4)
    built = GradientLayout(params, {p: f"p{i}" for i, p in enumerate(params)}, None)
    built.build(2 * MB, 64 * MB)
    assert [u.name for u in built.units] == ["grad.bucket0", "grad.bucket1"]
    assert built.fixed and not built.arenas


def test_a_sparse_gradient_leaves_its_run_and_a_run_left_empty_is_dropped():
    params = _params(4096, 2 * MB, 4096)
    names = {p: f"p{i}" for i, p in enumerate(params)}
    built = GradientLayout(params, names, None)
    built.build(0, 64 * MB)
    assert [u.name for u in built.units] == ["grad.p2..p1", "grad.p0"]
    run = built.make_sparse(params[0])  # the second run's only gradient
    assert run is not None and run.params == [] and [u.name for u in built.units] == [
        "grad.p2..p1"]
    run = built.make_sparse(params[2])
    assert run.params == [params[1]] and params[2].grad is None
    assert params[2] not in built.unit_of and not built.holds_all()
    # the sparse gradient's slot stays in the run's stretch, as zeros
    assert run.flat.numel() == (4096 + 2 * MB) // 4 and not run.flat.any()
