"""Autotune on 2 real workers: tuning finishes, ranks agree, the log has every row, and the
knobs chosen are the confirmed best of what the search measured. (How much tuned knobs gain
is a benchmark's to say: docs/performance.md and docs/autotune.md, with their commands.)"""

from __future__ import annotations

import csv
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from raytrain_x import Knobs
from raytrain_x.common.autotune_config import AutotuneConfig, SearchRules
from raytrain_x.ray import RayExecutor
from tests import limits
from tests.conftest import REPO
from tests.workers import run_workers

# Many small tensors: with fusion off (the start) each is its own collective.
TENSORS, ELEMENTS = 150, 2048


def _everyone_done(rx, step: int, attr: str = "done") -> bool:
    """True on every rank once rank 0's sampler is `attr` (an allreduce: all ranks agree)."""
    from raytrain_x.core import runtime

    sampler = runtime.autotune_sampler()
    done = torch.tensor([1.0 if sampler is None or getattr(sampler, attr) else 0.0])
    return rx.allreduce(done, op=rx.Min, name=f"done{step}").item() == 1.0


def _train_with_autotune() -> dict:
    import raytrain_x.torch as rx

    rx.init()
    tensors = [torch.ones(ELEMENTS) for _ in range(TENSORS)]
    for step in range(400):
        rx.grouped_allreduce_(tensors, name="grads")
        if step % 5 == 4 and _everyone_done(rx, step):
            break
    return {"knobs": rx.knobs().to_dict(), "steps": step + 1,
            "transport": rx.transport()}


def test_autotune_chooses_the_confirmed_best_over_the_start(ray_cluster, tmp_path):
    log_path = tmp_path / "autotune.csv"
    start = Knobs(fusion_threshold_bytes=0)  # far from the best for this workload
    config = AutotuneConfig(log_file=str(log_path), warmup_samples=1, steps_per_sample=3,
                            bayes_opt_max_samples=6,
                            initial_knobs=start, rules=SearchRules(convergence_patience=0))
    settings = RayExecutor.create_settings(timeout_s=30)
    executor = RayExecutor(settings, num_workers=2, autotune=config)
    # gloo, as between hosts: there every unfused tensor is a network round trip, so the
    # fusion knob matters most and the start is far behind
    executor.start(extra_env_vars={"RAYTRAIN_X_SHM": "0"})
    try:
        assert executor.autotune_controller is not None  # the controller is a Ray actor
        results = executor.run(_train_with_autotune)
    finally:
        executor.shutdown()
    assert {r["transport"] for r in results} == {"gloo"}
    assert results[0]["knobs"] == results[1]["knobs"]  # every rank ended identical
    assert results[0]["steps"] < 400  # tuning finished
    rows = list(csv.DictReader(log_path.open()))
    kinds = [r["kind"] for r in rows]
    # 5 search samples, then the best candidate other than the start measured again (an
    # `after` row follows only if training goes on long enough to measure it)
    assert kinds[:8] == ["warmup"] + ["sample"] * 5 + ["confirm", "best"]
    assert {r["unit"] for r in rows[:8]} == {"bytes/s"}  # no step marks: bytes per second
    assert rows[1]["searched"] == "fusion_threshold_bytes+cycle_time_ms"
    assert int(rows[1]["fusion_threshold_bytes"]) == 0  # the first sample is the start
    assert rows[6]["fusion_threshold_bytes"] != "0"
    scores: dict[str, list[float]] = {}
    for r in rows[1:7]:
        scores.setdefault(r["fusion_threshold_bytes"] + "/" + r["cycle_time_ms"], []).append(
            float(r["score"]))
    means = {k: sum(v) / len(v) for k, v in scores.items()}
    best = next(r for r in rows if r["kind"] == "best")
    best_key = best["fusion_threshold_bytes"] + "/" + best["cycle_time_ms"]
    assert float(best["score"]) == pytest.approx(means[best_key])  # mean score
    # chosen among the confirmed settings (measured twice) and the start, by mean; a
    # single lucky sample cannot win, and the start is far behind here
    start_key = rows[1]["fusion_threshold_bytes"] + "/" + rows[1]["cycle_time_ms"]
    confirmed = {k: m for k, m in means.items() if len(scores[k]) > 1 or k == start_key}
    assert len(scores[best_key]) == 2 and means[best_key] == max(confirmed.values())
    assert results[0]["knobs"]["fusion_threshold_bytes"] == int(best["fusion_threshold_bytes"])
    # the report and the plot
    plot = tmp_path / "autotune.png"
    out = limits.run([str(Path(sys.executable).parent / "raytrain-x"), "autotune-report",
                      str(log_path), "--plot", str(plot)], 30, "the autotune report and plot",
                     cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "best: bucket/fusion" in out.stdout and plot.stat().st_size > 10_000


def _resumed() -> dict:
    import raytrain_x.torch as rx
    from raytrain_x.core import runtime

    rx.init()
    return {"knobs": rx.knobs().to_dict(), "tuning": runtime.autotune_sampler() is not None}


def test_resume_starts_at_the_best_knobs_without_tuning(ray_cluster, tmp_path):
    from raytrain_x.common.autotune_log import AutotuneLog, Sample

    log_path = tmp_path / "old.csv"
    best = Knobs(fusion_threshold_bytes=8 << 20, cycle_time_ms=0.3)
    AutotuneLog(log_path).finish(Sample(3, best, 1e9, 40, 10.0))
    config = AutotuneConfig(resume_from=str(log_path))
    with RayExecutor(RayExecutor.create_settings(timeout_s=20), num_workers=2,
                     autotune=config) as executor:
        results = executor.run(_resumed)
    assert all(r["knobs"] == best.to_dict() and not r["tuning"] for r in results)


def _optimizer_with_autotune(log: str, bucket_cap_mb) -> dict:
    import raytrain_x.torch as rx
    from raytrain_x.core import runtime
    from raytrain_x.torch.workloads import shaped_model

    config = AutotuneConfig(log_file=log, warmup_samples=1, steps_per_sample=3,
                            bayes_opt_max_samples=5, rules=SearchRules(convergence_patience=0))
    rx.init(autotune=config)
    rx.autotune_batch_size(16)
    # 3 MB of gradients: runs of the arena the engine can fuse (a smaller model is one run,
    # where the fusion threshold cannot matter); 1 MB buckets, which it never fuses
    model = shaped_model([(512, 256)] * 6 + [(256,)] * 6)
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                  named_parameters=model.named_parameters(),
                                  bucket_cap_mb=bucket_cap_mb)
    scale = torch.ones(())
    deadline = time.monotonic() + 150  # steps are tiny: the searcher answers a few later
    step = 0
    while time.monotonic() < deadline:
        step += 1
        opt.zero_grad()
        model(scale).backward()
        opt.step()  # marks the step
        if step % 4 == 0 and _everyone_done(rx, step, "finished"):
            break
    sampler = runtime.autotune_sampler()
    return {"knobs": rx.knobs().to_dict(), "cap": opt.bucket_cap_bytes,
            "finished": sampler is None or sampler.finished}


@pytest.mark.parametrize("bucket_cap_mb,searched", [(None, "fusion_threshold_bytes+cycle_time_ms"),
                                                    (1.0, "cycle_time_ms")])
def test_autotune_on_the_default_optimizer_path(tmp_path, bucket_cap_mb, searched):
    log_path = tmp_path / "tune.csv"
    results = run_workers(_optimizer_with_autotune, 2, str(log_path), bucket_cap_mb,
                          work_s=50)
    assert results[0]["finished"]  # tuning and its cost measurement finished
    assert results[0]["knobs"] == results[1]["knobs"]
    rows = list(csv.DictReader(log_path.open()))
    assert [r["kind"] for r in rows][-2:] == ["best", "after"]
    scored = [r for r in rows if r["kind"] in ("sample", "confirm", "best")]
    assert {r["unit"] for r in scored} == {"samples/s"}  # step marks x batch size 16 x 2
    assert {r["searched"] for r in scored} == {searched}
    after = rows[-1]
    # cost = tuning time / (the same steps at the chosen knobs' time per step, measured
    # after tuning: the `after` row's score in steps/s); a value, not a bound, with steps
    # of a few milliseconds
    assert int(after["tuning_steps"]) >= 5 * 3 and after["unit"] == "steps/s"
    assert float(after["cost"]) == pytest.approx(
        float(after["tuning_s"]) * float(after["score"]) / int(after["tuning_steps"]), rel=1e-2)
    if bucket_cap_mb is None:  # the runs are cut at the threshold: it is searched
        assert results[0]["cap"] == 0
        assert len({int(r["fusion_threshold_bytes"]) for r in scored}) > 1
    else:  # fixed buckets: the threshold is out of the search
        assert results[0]["cap"] == 1 << 20
        assert {r["fusion_threshold_bytes"] for r in scored} == {str(64 << 20)}
    out = limits.run([str(Path(sys.executable).parent / "raytrain-x"), "autotune-report",
                      str(log_path)], 30, "the autotune report", cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "samples/s" in out.stdout and f"searched: {searched.replace('+', ', ')}" in out.stdout
    assert "cost of tuning" in out.stdout


_UNGUARDED = """\
import torch
import raytrain_x.torch as hvd   # Horovod's style: no `if __name__ == "__main__":` guard

hvd.init()
model = torch.nn.Linear(8, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
step = 0
while True:  # until tuning is done on rank 0, however long the search takes to start
    opt.zero_grad()
    model(torch.randn(16, 8)).pow(2).mean().backward()
    opt.step()
    step += 1
    if step % 10 == 0:
        from raytrain_x.core import runtime

        sampler = runtime.autotune_sampler()
        done = torch.tensor([1.0 if sampler is None or sampler.done else 0.0])
        if hvd.allreduce(done, op=hvd.Min, name="tuned").item() == 1.0:
            break
print("trained", hvd.rank())
"""


def test_autotune_never_runs_the_users_script_again(ray_cluster, tmp_path):
    """The search's process was started with `spawn`, which imports the script as its main
    module: an unguarded script ran `init()` again in it and failed ("Address already in
    use"); rank 0 died with "the autotune controller process ended". The launched script
    now scores samples, and the report draws them."""
    script = tmp_path / "train.py"
    script.write_text(_UNGUARDED)
    log_path = tmp_path / "tune.csv"
    bin_dir = Path(sys.executable).parent
    out = limits.run([str(bin_dir / "raytrain-x"), "run", "-np", "2", "--address", ray_cluster,
                      "--autotune", "--autotune-log-file", str(log_path),
                      "--autotune-warmup-samples", "1", "--autotune-steps-per-sample", "20",
                      "--autotune-bayes-opt-max-samples", "4", "python", str(script)],
                     40, "an unguarded script under --autotune", cwd=tmp_path,
                     env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trained 0" in out.stdout and "trained 1" in out.stdout
    assert "Address already in use" not in out.stdout + out.stderr
    kinds = [r["kind"] for r in csv.DictReader(log_path.open())]
    assert kinds.count("sample") >= 2 and "best" in kinds, kinds
    plot = tmp_path / "tune.png"
    report = limits.run([str(bin_dir / "raytrain-x"), "autotune-report", str(log_path),
                         "--plot", str(plot)], 30, "the autotune report", cwd=REPO)
    assert report.returncode == 0 and plot.stat().st_size > 10_000, report.stderr
