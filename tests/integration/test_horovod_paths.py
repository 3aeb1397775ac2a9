"""Horovod's import paths with `horovod` changed to `raytrain_x`, as docs/porting.md's table
lists them, and `horovod.run(func, np=...)` as Horovod's examples call it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.limits import limit

PORTING = Path(__file__).resolve().parents[2] / "docs" / "porting.md"

# Every path Horovod's docs and examples import from (its README, docs/*.rst and examples/,
# PyTorch, TensorFlow, Keras and Ray): the table must name each.
HOROVOD_PATHS = {
    "horovod", "horovod.torch", "horovod.torch.elastic", "horovod.torch.elastic.sampler",
    "horovod.torch.mpi_ops", "horovod.tensorflow", "horovod.tensorflow.elastic",
    "horovod.tensorflow.keras", "horovod.tensorflow.keras.callbacks",
    "horovod.tensorflow.keras.elastic", "horovod.keras", "horovod.keras.callbacks",
    "horovod.keras.elastic", "horovod.ray", "horovod.ray.elastic",
}


def _table() -> dict[str, tuple[str, list[str]]]:
    text = PORTING.read_text()
    block = text[text.index("<!-- horovod-paths -->"):text.index("<!-- /horovod-paths -->")]
    rows = {}
    for line in block.splitlines()[3:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3:
            rows[cells[0].strip("`")] = (cells[1].strip("`"), re.findall(r"`(\w+)`", cells[2]))
    return rows


def test_the_porting_table_names_every_horovod_import_path():
    table = _table()
    assert set(table) == HOROVOD_PATHS, set(table) ^ HOROVOD_PATHS
    for horovod, (ours, _) in table.items():
        assert ours == "raytrain_x" + horovod[len("horovod"):], (horovod, ours)


def test_every_path_imports_with_its_names():
    """In one fresh interpreter: `from raytrain_x.ray.elastic import TestDiscovery` (Horovod's
    `basic_ray_elastic.py`) failed, and `raytrain_x.run` did not exist."""
    checks = "\n".join(
        f"m = importlib.import_module({ours!r})\n"
        f"missing += [{ours!r} + '.' + n for n in {names!r} if not hasattr(m, n)]"
        for ours, names in _table().values())
    code = f"import importlib\nmissing = []\n{checks}\nprint('missing', missing)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=limit(120), env={"TF_CPP_MIN_LOG_LEVEL": "3",
                                                  "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "missing []", out.stdout[-2000:]


def _train(lr: float) -> dict:
    """pytorch_mnist.py's `train(args)`, made small: it calls init() itself."""
    import torch

    import raytrain_x.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="ranks")
    out = {"rank": hvd.rank(), "size": hvd.size(), "sum": total.item(), "lr": lr}
    hvd.shutdown()
    return out


def test_run_a_function_on_n_workers_as_horovod_run_does(ray_cluster):
    import raytrain_x
    from raytrain_x.common.errors import ConfigError

    # Horovod's pytorch_mnist.py: horovod.run(train, args=(args,), np=..., hosts=...,
    # use_gloo=..., use_mpi=..., verbose=2)
    results = raytrain_x.run(_train, args=(0.01,), np=2, hosts=None, use_gloo=True,
                             use_mpi=False, verbose=2)
    assert results == [{"rank": r, "size": 2, "sum": 3.0, "lr": 0.01} for r in (0, 1)]
    with pytest.raises(ConfigError, match="no MPI"):
        raytrain_x.run(_train, args=(0.01,), np=2, use_mpi=True)
    with pytest.raises(ConfigError, match="hostfile"):
        raytrain_x.run(_train, args=(0.01,), np=2, hostfile="hosts.txt")
