"""A pytest plugin that records each test's wall time and the whole machine's CPU time
while it ran (every process: pytest, its rank processes, the Ray cluster's), then prints
the tests that took the most CPU. Run the tests alone, in one process, so that the CPU is
theirs:

    PYTHONPATH=tools .venv/bin/python -m pytest -p cpu_by_test tests/integration/test_elastic.py

`RAYTRAIN_X_TEST_CPU_OUT=file.json` also writes every row as JSON.
"""

from __future__ import annotations

import json
import os
import time

import pytest

_rows: list[tuple[str, float, float]] = []


def _busy_s() -> float:
    """CPU seconds every core has spent busy since boot (/proc/stat's first line)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    busy, began = _busy_s(), time.monotonic()
    yield
    _rows.append((item.nodeid, time.monotonic() - began, _busy_s() - busy))


def pytest_terminal_summary(terminalreporter):
    if not _rows:
        return
    cores = os.cpu_count() or 1
    wall, cpu = sum(r[1] for r in _rows), sum(r[2] for r in _rows)
    report = terminalreporter
    report.section("CPU by test (every process on the machine)")
    report.write_line(f"{len(_rows)} tests: {wall:.0f} s wall, {cpu:.0f} CPU-seconds "
                      f"({cpu / max(wall, 1e-9) / cores:.0%} of {cores} cores)")
    report.write_line(f"{'wall s':>7} {'CPU s':>7} {'busy':>5}  test")
    for nodeid, w, c in sorted(_rows, key=lambda r: -r[2])[:25]:
        report.write_line(f"{w:7.1f} {c:7.1f} {c / max(w, 1e-9) / cores:5.0%}  {nodeid}")
    out = os.environ.get("RAYTRAIN_X_TEST_CPU_OUT")
    if out:
        with open(out, "w") as f:
            json.dump([{"test": n, "wall_s": w, "cpu_s": c} for n, w, c in _rows], f)
