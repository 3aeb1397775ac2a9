"""A script written against Horovod's API runs unchanged once its import is swapped
(tests/scripts/horovod_style_train.py), with Horovod's launch variables."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests import limits
from tests.conftest import REPO
from tests.workers import free_port


def test_a_horovod_script_runs_unchanged_with_horovod_variables(tmp_path):
    timeline = tmp_path / "timeline.json"
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": str(REPO), "RAYTRAIN_X_SIZE": "2",
               "RAYTRAIN_X_RANK": str(rank), "RAYTRAIN_X_STORE_ADDR": "127.0.0.1",
               "RAYTRAIN_X_STORE_PORT": str(port),
               # a Horovod launch script's settings, read as aliases of ours
               "HOROVOD_FUSION_THRESHOLD": str(1 << 20), "HOROVOD_CYCLE_TIME": "2",
               "HOROVOD_TIMELINE": str(timeline)}
        procs.append(subprocess.Popen(
            [sys.executable, str(Path(REPO) / "tests/scripts/horovod_style_train.py")], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=limits.limit(20))[0])
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(limits.first_error(o) for o in outs)
    match = re.search(r"ranks \[0, 1\] sum \[2.0, 2.0, 2.0\] caught (\w+)", outs[0])
    assert match and match.group(1) == "TensorMismatchError", outs[0][-2000:]
    rows = {e["args"]["name"] for e in json.loads(timeline.read_text())
            if e.get("name") == "thread_name"}
    assert "allreduce.avg_loss" in rows  # HOROVOD_TIMELINE was honoured
