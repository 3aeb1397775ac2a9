"""The job's metrics as pure logic: a rank's status snapshots become counter growth, gauge
values and histogram observations; the elastic event log becomes rounds, resets,
failures and recoveries; the progress line; a failing recorder never reaches the job.
(`tests/integration/test_metrics.py` scrapes the same metrics from real Ray.)"""

from __future__ import annotations

import json
import threading

from raytrain_x.ray.elastic.events import EventLog
from raytrain_x.ray.job_progress import progress_line
from raytrain_x.ray.metrics import (
    BY_NAME,
    METRICS,
    PHASES,
    DriverMetrics,
    ExportThread,
    WorkerExporter,
    safe,
)


class ListRecorder:
    def __init__(self) -> None:
        self.records: list[tuple[str, float, dict]] = []

    def record(self, name, value, tags) -> None:
        assert name in BY_NAME, name
        assert set(tags) == set(BY_NAME[name].tags), (name, tags)
        self.records.append((name, value, dict(tags)))

    def sum(self, name, **tags) -> float:
        return sum(v for n, v, t in self.records
                   if n == name and all(t.get(k) == x for k, x in tags.items()))

    def last(self, name, **tags) -> float:
        return [v for n, v, t in self.records
                if n == name and all(t.get(k) == x for k, x in tags.items())][-1]


def _engine(cycles=10, allreduce=1000, seconds=0.5, fused=2, tensors=6, **more) -> dict:
    return {"bytes": {"allreduce": allreduce}, "seconds": {"allreduce": seconds},
            "cycles": cycles, "active_cycles": cycles // 2, "negotiations": 3,
            "speculated": 1, "speculation_misses": 0, "fused": fused, "fused_tensors": tensors,
            "fused_in_place": 1, "stalls": 0, "cache_hits": 4, **more}


def _snap(time, steps, durations=(), engine=None, autotune=None, rank=0, size=2,
          batch_size=None) -> dict:
    return {"time": time, "steps": steps, "step_seconds": list(durations), "rank": rank,
            "size": size, "round": 1, "batch_size": batch_size, "engine": engine,
            "autotune": autotune}


def test_counters_grow_by_what_each_snapshot_adds_and_a_new_engine_starts_from_zero():
    rec = ListRecorder()
    exporter = WorkerExporter("j", "h1", rec)
    exporter.export(_snap(100.0, 4, [0.1, 0.2, 0.1], _engine()))
    exporter.export(_snap(102.0, 10, [0.1] * 3 + [0.3] * 6, _engine(cycles=30, allreduce=3000),
                          batch_size=8))
    # between two rounds: no rank, no engine; its steps still count as rank 0's
    exporter.export(_snap(103.0, 11, [0.3] * 8, rank=None))
    # an elastic reset: a new engine, its counters from 0; steps keep counting
    exporter.export(_snap(104.0, 12, [0.3] * 8, _engine(cycles=5, allreduce=200)))
    rank0 = {"job": "j", "rank": "0", "host": "h1"}
    assert rec.sum("steps", **rank0) == 12 == rec.sum("steps")
    # each step's duration once: 3, then the 6 new of 9 kept, then 2 new
    assert len([r for r in rec.records if r[0] == "step_seconds"]) == 3 + 6 + 1 + 1
    assert rec.sum("engine_cycles") == 10 + 20 + 5
    assert rec.sum("collective_bytes", kind="allreduce") == 1000 + 2000 + 200
    assert rec.last("steps_per_second") == 1.0  # 2 steps in 2 s
    assert [v for n, v, _ in rec.records if n == "samples_per_second"] == [6 * 8 / 2]


def test_autotune_samples_are_counted_once_and_every_phase_is_set_each_time():
    rec = ListRecorder()
    exporter = WorkerExporter("j", "h1", rec)

    def tune(n, phase, best):
        return {"phase": phase, "unit": "samples/s", "best_score": best,
                "knobs": {"cycle_time_ms": 5.0, "hierarchical_allreduce": True},
                "samples": [{"index": i, "score": 10.0 + i, "warmup": i == 0, "knobs": {}}
                            for i in range(n)]}

    exporter.export(_snap(1.0, 5, autotune=tune(1, "warmup", None)))
    exporter.export(_snap(2.0, 9, autotune=tune(3, "scoring", 12.0)))
    exporter.export(_snap(3.0, 9, autotune=tune(3, "scoring", 12.0)))
    assert rec.sum("autotune_samples") == 3
    assert {t["sample"]: v for n, v, t in rec.records if n == "autotune_sample_score"} == \
        {"0": 10.0, "1": 11.0, "2": 12.0}
    # every export sets every score again (Ray drops a gauge not set for two intervals)
    assert [t["sample"] for n, _, t in rec.records if n == "autotune_sample_score"] == \
        ["0", "0", "1", "2", "0", "1", "2"]
    assert rec.last("autotune_best_score") == 12.0
    assert rec.last("autotune_knob", knob="hierarchical_allreduce") == 1.0
    last_phases = {t["phase"]: v for n, v, t in rec.records[-len(PHASES):]}
    assert last_phases == {p: float(p == "scoring") for p in PHASES}


def test_the_driver_turns_the_event_log_into_rounds_resets_failures_and_recoveries():
    now = [0.0]
    log = EventLog(clock=lambda: now[0])
    rec = ListRecorder()
    blacklisted = []
    driver = DriverMetrics("j", rec, blacklisted=lambda: len(blacklisted))
    log.listeners.append(driver.on_event)
    log.add("place", "n1")
    log.record_round(1, size=2, hosts=2, starting=0, requested=0, draining_nodes=0)
    now[0] = 10.0
    blacklisted.append("n2")
    log.add("failure", "n2", cooldown_s=float("inf"), cause="process_lost")
    log.note("failure", failed=1)
    now[0] = 13.5
    log.record_round(2, size=1, hosts=1, starting=0, requested=0, draining_nodes=0)
    log.add("drain", "n1")
    log.note("drain", left=1)
    log.record_round(3, size=1, hosts=1, starting=0, requested=0, draining_nodes=1)
    assert [v for n, v, _ in rec.records if n == "world_size"] == [2, 1, 1]
    assert rec.sum("rounds", reason="start") == 1 and rec.sum("rounds", reason="failure") == 1
    assert rec.sum("rounds", reason="drain") == 1
    assert rec.sum("resets") == 1  # a drain's round is no reset
    assert rec.sum("worker_failures", cause="process_lost") == 1
    assert [v for n, v, _ in rec.records if n == "recovery_seconds"] == [3.5]
    assert rec.sum("elastic_events", kind="drain") == 1
    assert rec.last("blacklisted_hosts") == 1


class _Counting(ListRecorder):
    """A `ListRecorder` that says when it has 3 records (`third`)."""

    def __init__(self) -> None:
        super().__init__()
        self.third = threading.Event()

    def record(self, name, value, tags) -> None:
        super().record(name, value, tags)
        if len(self.records) >= 3:
            self.third.set()


def test_the_driver_sets_its_gauges_again_until_closed():
    rec = _Counting()
    driver = DriverMetrics("j", rec).start(0.01)
    driver.world_size(3)  # once here, then by the refresh thread
    assert rec.third.wait(30)
    driver.close()  # returns once the thread has stopped
    count = len(rec.records)
    assert {(n, v) for n, v, _ in rec.records} == {("world_size", 3)}
    driver.close()
    assert len(rec.records) == count


def test_the_driver_sets_its_gauges_within_rays_report_interval_whatever_the_interval(
        monkeypatch):
    """With a long export interval (600 s) the driver set `world_size` once at the start:
    Ray's agent dropped it after two of its report intervals, before a slow job's first
    step exported the workers' series (the suite's launched-job metrics test, on a loaded
    machine). Its gauges are now set again at least every `GAUGE_REFRESH_S`."""
    from raytrain_x.ray import metrics as metrics_module

    monkeypatch.setattr(metrics_module, "GAUGE_REFRESH_S", 0.01)

    rec = _Counting()
    driver = DriverMetrics("j", rec).start(600)
    driver.world_size(2)  # once here, then by the refresh thread, not 600 s later
    assert rec.third.wait(30)
    driver.close()


def test_a_recorder_that_fails_is_reported_once_and_never_reaches_the_job(caplog):
    class Broken:
        def record(self, name, value, tags):
            raise RuntimeError("no metrics agent")

    thread = ExportThread(lambda: _snap(1.0, 1), WorkerExporter("j", "h", Broken()), 60)
    thread.once()
    thread.once()
    record = safe(Broken().record)
    record("world_size", 1, {"job": "j"})
    record("world_size", 1, {"job": "j"})
    warnings = [r for r in caplog.records if "could not" in r.getMessage()]
    assert len(warnings) == 2  # one per exporter, not one per call


def test_every_metric_follows_prometheus_naming():
    for spec in METRICS:
        assert spec.name == spec.name.lower() and not spec.name.endswith("_total")
        assert spec.kind in ("counter", "gauge", "histogram")
        if spec.name.endswith("_seconds") or spec.name.endswith("_bytes"):
            assert spec.kind != "gauge"
        assert (spec.kind == "histogram") == bool(spec.buckets)


def test_the_progress_line_gives_steps_rate_world_and_autotune():
    before = _snap(100.0, 40, size=2)
    tune = {"phase": "scoring", "unit": "samples/s", "best_score": 1234.5, "knobs": {},
            "samples": [{"index": 0, "warmup": True}, {"index": 1, "warmup": False}]}
    now = [_snap(110.0, 140, size=2, batch_size=16, autotune=tune), _snap(110.0, 140, rank=1)]
    line = progress_line(before, now)
    assert line == ("raytrain-x: 140 steps, 10.00 steps/s (320 samples/s), 2 workers "
                    "(round 1), autotune scoring (1 samples, best 1,234.5 samples/s)")
    assert progress_line(None, now[:1]).startswith("raytrain-x: 140 steps, 2 workers")
    assert "no worker" in progress_line(None, [])
    json.dumps(now)  # what a launched process writes to its status file


def test_the_dashboard_shows_every_metric_with_queries_of_exported_names(tmp_path):
    import re

    from raytrain_x.ray import grafana

    board = json.loads(json.dumps(grafana.dashboard()))  # what Grafana imports
    panels = [p for p in board["panels"] if p["type"] == "timeseries"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    exported = {grafana.series_name(s.name, part) for s in METRICS
                for part in (("bucket", "sum", "count") if s.kind == "histogram" else ("",))}
    used = {name for e in exprs for name in re.findall(r"ray_raytrain_x_\w+", e)}
    assert used <= exported, used - exported
    shown = {grafana.series_name(s.name, "bucket" if s.kind == "histogram" else "")
             for s in METRICS}
    assert shown <= used, f"metrics without a panel: {shown - used}"
    assert all('job=~"$job"' in e for e in exprs)
    assert all(e.count("(") == e.count(")") for e in exprs)
    # no two panels overlap on the grid
    cells = [(p["gridPos"]["x"] + dx, p["gridPos"]["y"] + dy) for p in board["panels"]
             for dx in range(p["gridPos"]["w"]) for dy in range(p["gridPos"]["h"])]
    assert len(cells) == len(set(cells))


def test_the_dashboard_command_writes_or_installs_beside_rays_dashboards(tmp_path, capsys):
    from raytrain_x import cli

    assert cli.main(["dashboard", "--out", str(tmp_path / "d.json")]) == 0
    assert json.loads((tmp_path / "d.json").read_text())["uid"] == "raytrain-x"
    grafana_dir = tmp_path / "session_latest" / "metrics" / "grafana"
    assert cli.main(["dashboard", "--install", "--ray-temp-dir", str(tmp_path / "none")]) == 2
    assert "start Ray on this machine first" in capsys.readouterr().err
    grafana_dir.mkdir(parents=True)
    assert cli.main(["dashboard", "--install", "--ray-temp-dir", str(tmp_path)]) == 0
    assert json.loads((grafana_dir / "dashboards" / "raytrain_x_dashboard.json").read_text())


def test_the_guide_lists_every_metric_with_its_kind_and_tags():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    for spec in METRICS:
        rows = [line for line in doc.splitlines()
                if line.startswith(f"| `raytrain_x_{spec.name}` |")]
        assert rows, f"raytrain_x_{spec.name} is not in docs/metrics.md"
        cells = [c.strip() for c in rows[0].split("|")]
        assert cells[2] == spec.kind and cells[3] == ", ".join(spec.tags), rows[0]


def test_the_first_export_has_a_rate_and_comes_with_the_first_step():
    """The first export had no steps/s (it needs two exports), and came an interval after
    the first step; the first progress line had no rate either."""
    import time

    from raytrain_x.common.periodic import Every

    rec = ListRecorder()
    WorkerExporter("j", "h1", rec).export(_snap(100.0, 4, [0.5, 0.5, 0.5, 0.5]))
    assert rec.last("steps_per_second") == 2.0
    assert "2.00 steps/s" in progress_line(None, [_snap(100.0, 4, [0.5] * 4)])
    # an hour's interval, and the first step is taken at once
    calls: list[float] = []
    stepped = threading.Event()
    every = Every(3600.0, lambda: (calls.append(time.monotonic()), stepped.set()), "t",
                  settled=lambda: bool(calls)).start()
    try:
        assert stepped.wait(30)
    finally:
        every.stop()
    assert len(calls) == 1  # then settled: the next call is an hour away
