"""The layer map of docs/architecture.md holds: import-linter's contracts pass on this tree and
fail on the inversions the restructure removed; the driver side imports neither torch nor
Ray Tune."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import limits

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "raytrain_x"

# Runs lint-imports on the package under `sys.argv[1]` (the editable install's finder
# would otherwise resolve `raytrain_x` to this checkout).
_LINT = """
import os, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
sys.path.insert(0, sys.argv[1])
os.chdir(sys.argv[1])
from importlinter.cli import lint_imports
sys.exit(lint_imports())
"""


def _lint(tree: Path) -> subprocess.CompletedProcess:
    return limits.run([sys.executable, "-c", _LINT, str(tree)], 30,
                      "import-linter on a copy of the package")


def _copy_tree(tmp_path: Path) -> Path:
    shutil.copytree(PACKAGE, tmp_path / "raytrain_x",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_contracts_hold_on_this_tree(tmp_path):
    out = _lint(_copy_tree(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "broken" in out.stdout and "0 broken" in out.stdout


# The three inversions issue 13 found, re-introduced one at a time.
INVERSIONS = {
    "elastic state reaches into the torch face":
        ("elastic/state.py", "from raytrain_x.torch.functions import broadcast_object"),
    "the worker-side runtime imports the Tune integration":
        ("core/runtime.py", "from raytrain_x.tune_integration import trainable"),
    "elastic code imports the executor":
        ("elastic/state.py", "from raytrain_x.ray.executor import RayExecutor"),
    "the driver needs torch":
        ("ray/worker.py", "from raytrain_x.comm.torch_store import RayStore"),
    "the engine imports torch":
        ("engine/execution.py", "import torch"),
    "the TensorFlow face leans on the torch face":
        ("tensorflow/ops.py", "from raytrain_x.torch.ops import allreduce"),
    "the executor imports the TensorFlow face":
        ("ray/executor.py", "import raytrain_x.tensorflow"),
    "the torch face's async forms reach for the blocking ones (the old ops/autograd circle)":
        ("torch/async_ops.py", "from raytrain_x.torch.ops import allreduce"),
    "an import circle inside a package (the simulator's model and world)":
        ("testing/simulation/model.py", "from raytrain_x.testing.simulation import world"),
}


@pytest.mark.parametrize("inversion", sorted(INVERSIONS))
def test_each_old_inversion_breaks_a_contract(tmp_path, inversion):
    tree = _copy_tree(tmp_path)
    module, line = INVERSIONS[inversion]
    path = tree / "raytrain_x" / module
    text = path.read_text()
    anchor = "from __future__ import annotations\n"
    path.write_text(text.replace(anchor, anchor + line + "  # noqa\n", 1))
    out = _lint(tree)
    assert out.returncode != 0, f"{inversion} went unnoticed:\n{out.stdout[-2000:]}"
    assert "BROKEN" in out.stdout


# docs/architecture.md: a module is one concept, however long that takes; past this ceiling
# it is almost surely two
MAX_MODULE_LINES = 700


def test_no_module_of_the_package_is_over_the_ceiling():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for p in PACKAGE.rglob("*.py")}
    assert not {p: n for p, n in sizes.items() if n > MAX_MODULE_LINES}


def test_only_the_engine_and_comm_call_the_native_core():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        layer = path.relative_to(PACKAGE).parts[0]
        if layer in ("engine", "comm"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.ImportFrom) else [])
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if "_native" in names or (module or "").endswith("_native"):
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders


def _modules_after(statement: str) -> set[str]:
    """Framework, Ray and Ray Tune modules loaded by `statement` in a fresh interpreter."""
    code = (f"import sys, json; {statement}; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'tensorflow', 'ray') and m.count('.') < 2)))")
    out = limits.run([sys.executable, "-c", code], 30, f"a fresh interpreter to run {statement!r}")
    assert out.returncode == 0, out.stderr[-2000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("statement", [
    "import raytrain_x.ray",
    "from raytrain_x.ray import RayExecutor",
    "import raytrain_x.cli",
])
def test_the_driver_side_loads_neither_torch_nor_ray_tune(statement):
    loaded = _modules_after(statement)
    assert not {m for m in loaded if m.split(".")[0] in ("torch", "tensorflow")}
    assert "ray.tune" not in loaded


@pytest.mark.parametrize("statement", [
    "import raytrain_x.elastic",
    "import raytrain_x.core",
    "import raytrain_x.comm.shm",
    "import raytrain_x.engine.engine",
])
def test_the_neutral_layers_load_no_framework(statement):
    assert not {m for m in _modules_after(statement) if m.split(".")[0] != "ray"}


def test_a_worker_launched_without_ray_never_loads_ray():
    # a script under `raytrain-x run` meets at a TCP store: importing Ray there would cost
    # ~0.4 s and ~30 MB per rank (it did, through the store module, before this test)
    statement = ("import raytrain_x.torch as rx; import raytrain_x.comm.torch_backend; "
                 "import raytrain_x.comm.torch_store")
    assert not {m for m in _modules_after(statement) if m.split(".")[0] == "ray"}


@pytest.mark.parametrize("statement", ["import raytrain_x.tensorflow",
                                       "import raytrain_x.tensorflow.keras"])
def test_the_tensorflow_face_loads_neither_torch_nor_ray(statement):
    # torch's gloo is loaded by rx.init() (the transport), never by the import
    loaded = _modules_after(statement)
    assert "tensorflow" in loaded
    assert not {m for m in loaded if m.split(".")[0] in ("torch", "ray")}


def test_only_the_internals_module_calls_private_ray_apis():
    import re

    private = re.compile(r"\bray\._\w+|ray\.autoscaler\._private|from ray\._private")
    users = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                   if p.name != "internals.py" and private.search(p.read_text()))
    assert users == [], f"private Ray APIs outside raytrain_x/ray/internals.py: {users}"


def test_ray_versions_outside_the_tested_range_are_named():
    from raytrain_x.common.errors import ConfigError
    from raytrain_x.ray import internals

    internals.check_version("2.60.0")
    with pytest.raises(ConfigError, match="needs Ray >= 2.60, found 2.9.3"):
        internals.check_version("2.9.3")
