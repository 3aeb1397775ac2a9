"""A job's metrics on real Ray: a 2-worker elastic job with autotune loses a worker, and
Prometheus's view of the cluster (every node's metrics agent, scraped over loopback) holds
what the job's own records say: the steps each process took, the world size before and
after, one failure, the autotune samples."""

from __future__ import annotations

import json
import os
import threading

import ray

from raytrain_x.common.autotune_config import AutotuneConfig, SearchRules
from raytrain_x.ray.executor import RayExecutor
from raytrain_x.testing.prometheus import Series, scrape_cluster, total
from tests.conftest import ELASTIC_RESOURCE
from tests.limits import limit, wait_until

P = "ray_raytrain_x_"


def _train(stop: str, release: str, records: str) -> dict:
    """Trains until `stop` exists (every rank stops at the same step), writes what this
    process counted (its steps, and on rank 0 its autotune samples), then waits for
    `release`, so the test reads the metrics while the workers still export them."""
    import time

    import torch

    import raytrain_x.torch as rx
    from raytrain_x.core import runtime

    rx.init()
    model = torch.nn.Linear(16, 4)
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters())
    rx.autotune_batch_size(8)
    state = rx.elastic.TorchState(model, opt, step=0)

    def stopping() -> bool:
        flag = torch.tensor([float(os.path.exists(stop))])
        return bool(rx.allreduce(flag, op=rx.Max, name="metrics.stop").item())

    @rx.elastic.run
    def train(state):
        while not stopping():
            opt.zero_grad()
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            state.step += 1
            time.sleep(0.02)
            state.commit()

    train(state)
    mine = {"pid": os.getpid(), "rank": rx.rank(), "steps": runtime.step_clock().steps,
            "autotune_samples": len(runtime.autotune_samples())}
    with open(os.path.join(records, f"{os.getpid()}.json"), "w") as f:
        json.dump(mine, f)
    while not os.path.exists(release):
        time.sleep(0.05)
    return mine


def _records(folder) -> list[dict]:
    return [json.loads(p.read_text()) for p in folder.iterdir()]


def test_an_elastic_jobs_metrics_reach_prometheus(elastic_nodes, tmp_path):
    elastic_nodes(2)
    stop, release, records = tmp_path / "stop", tmp_path / "release", tmp_path / "records"
    records.mkdir()
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=10), min_workers=1,
                           max_workers=2, cpus_per_worker=1,
                           resources_per_worker={ELASTIC_RESOURCE: 1}, name="metrics-test",
                           autotune=AutotuneConfig(warmup_samples=1, steps_per_sample=4,
                                                   bayes_opt_max_samples=4,
                                                   rules=SearchRules(sub_windows=1)))
    executor.start(extra_env_vars={"RAYTRAIN_X_METRICS_INTERVAL_S": "0.2"})  # the workers
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(
        result=executor.run(_train, args=(str(stop), str(release), str(records)))),
        daemon=True)
    thread.start()
    seen: list[Series] = []

    def exported(condition) -> bool:
        seen[:] = scrape_cluster()
        return condition(seen)

    job = {"job": "metrics-test"}
    try:
        # Ray's agents publish what a process recorded every few seconds (its report interval)
        wait_until(lambda: exported(lambda s: total(s, P + "world_size", **job) == 2
                                    and total(s, P + "steps_total", **job) > 0
                                    and total(s, P + "autotune_samples_total", **job) >= 1),
                   20, "2 workers, their steps and a scored autotune sample in Prometheus",
                   state=lambda: sorted({s.name for s in seen}))
        assert total(seen, P + "rounds_total", **job, reason="start") == 1
        victim = max(executor.last_elastic_job.members.values(), key=lambda m: m.age)
        ray.kill(victim.actor, no_restart=True)
        wait_until(lambda: executor.last_elastic_job.rounds >= 2, 20,
                   "the round without the killed worker")
        stop.touch()
        wait_until(lambda: len(_records(records)) == 1, 20, "the survivor's record")
        mine = _records(records)[0]
        series = {"job": "metrics-test", "rank": str(mine["rank"])}
        wait_until(lambda: exported(
            lambda s: total(s, P + "steps_total", **series) == mine["steps"]
            and total(s, P + "autotune_samples_total", **job) == mine["autotune_samples"]
            and total(s, P + "world_size", **job) == 1
            and total(s, P + "worker_failures_total", **job) == 1),
            20, f"the survivor's {mine['steps']} steps, {mine['autotune_samples']} autotune "
                "samples, a world of 1 and one failure in Prometheus",
            state=lambda: {name: total(seen, P + name, **labels) for name, labels in (
                ("steps_total", series), ("autotune_samples_total", job),
                ("world_size", job), ("worker_failures_total", job))})
    finally:
        release.touch()
        thread.join(limit(20))
        executor.shutdown()
    assert outcome["result"] == [mine]
    assert total(seen, P + "worker_failures_total", **job, cause="process_lost") == 1
    assert total(seen, P + "rounds_total", **job, reason="failure") == 1
    assert total(seen, P + "resets_total", **job) == 1
    assert total(seen, P + "recovery_seconds_count", **job) == 1
    assert total(seen, P + "step_seconds_count", **series) > 0
    assert total(seen, P + "collective_bytes_total", **series, kind="allreduce") > 0
    assert total(seen, P + "autotune_phase", **job) == 1  # one phase is the current one


_LAUNCHED = """\
import sys, time, torch, raytrain_x.torch as rx
from pathlib import Path
rx.init()
model = torch.nn.Linear(16, 4)
opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                              named_parameters=model.named_parameters())
stop = Path(sys.argv[1])
while True:
    opt.zero_grad()
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    time.sleep(0.02)
    flag = torch.tensor([float(stop.exists())])
    if rx.allreduce(flag, op=rx.Max, name="stop").item():
        break
"""

# what every job that steps exports (the counters of events it may never meet, such as
# stalls or failures, appear once they count: docs/metrics.md)
EVERY_STEP = ["steps_total", "step_seconds_count", "steps_per_second",
              "collective_bytes_total", "collective_seconds_total", "engine_cycles_total",
              "engine_active_cycles_total", "world_size"]


def test_a_launched_jobs_step_series_appear_with_its_first_steps(ray_cluster, tmp_path):
    """A 23 s job launched by `raytrain-x run` showed only steps, step seconds and world
    size: a worker exported every interval (5 s), after its status file's own interval, so
    a series could wait two intervals and Ray's report interval. Each now exports as soon
    as the first step is there. With the interval at 600 s, the series can only come from
    that first export, and every per-step series is in it."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import REPO

    script, stop = tmp_path / "job.py", tmp_path / "stop"
    script.write_text(_LAUNCHED)
    name = f"first-steps-{os.getpid()}"
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "raytrain-x"), "run", "-np", "2", "--address",
         ray_cluster, "--job-name", name, "--quiet", "python", str(script), str(stop)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "RAY_AUTH_MODE": "disabled",
             "RAYTRAIN_X_METRICS_INTERVAL_S": "600"})
    seen: list[Series] = []

    def exported() -> bool:
        seen[:] = scrape_cluster()
        return all(total(seen, P + name_, job=name) > 0 for name_ in EVERY_STEP)

    try:
        wait_until(exported, 20, "every per-step series of the launched job",
                   state=lambda: sorted({s.name for s in seen
                                         if s.labels.get("job") == name}))
    finally:
        stop.touch()
        out, err = proc.communicate(timeout=limit(30))
    assert proc.returncode == 0, err[-3000:]
