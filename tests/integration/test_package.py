"""The package a user installs: the wheel `make wheel` builds, installed (not editable) into
a clean virtual environment, runs the torch demo outside the source tree; and the docs site
builds with warnings as errors and every internal link resolved."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

from tests import limits
from tests.conftest import REPO as _REPO

BIN = Path(sys.executable).parent
REPO = Path(_REPO)


def _sources() -> list[str]:
    """Where pip is configured to look, as uv options (what `make` passes uv)."""
    out = subprocess.run([sys.executable, str(REPO / "requirements" / "pip_sources.py")],
                         capture_output=True, text=True, check=True).stdout
    return shlex.split(out)


def test_the_wheel_installs_and_runs_the_demo_outside_the_source_tree(tmp_path):
    built = limits.run([str(BIN / "uv"), "build", "--wheel", "--no-build-isolation",
                        "--python", sys.executable, "--out-dir", str(tmp_path / "dist"),
                        str(REPO)], 60, "uv build --wheel", cwd=REPO)
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = (tmp_path / "dist").glob("raytrain_x-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for shipped in ("raytrain_x/py.typed", "raytrain_x/tensorflow/csrc/async_kernel.cc"):
        assert shipped in names
    assert any(n.startswith("raytrain_x/_native.") and n.endswith(".so") for n in names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=limits.limit(10))
    installed = limits.run(
        [str(BIN / "uv"), "pip", "install", "--python", str(venv / "bin" / "python"),
         "-c", str(REPO / "requirements" / "dev-constraints.txt"), *_sources(),
         f"{wheel}[torch,examples]"], 60, "uv pip install of the wheel")
    assert installed.returncode == 0, installed.stderr[-3000:]

    # the demo script alone in a folder of its own: nothing of the source tree is importable
    work = tmp_path / "work"
    work.mkdir()
    (work / "torch_digits.py").write_text((REPO / "examples" / "torch_digits.py").read_text())
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    env["RAY_AUTH_MODE"] = "disabled"
    where = limits.run([str(venv / "bin" / "python"), "-c",
                        "import raytrain_x, raytrain_x._native; print(raytrain_x.__file__)"],
                       10, "importing the installed package", cwd=work, env=env)
    assert where.returncode == 0, where.stderr[-2000:]
    assert where.stdout.strip().startswith(str(venv)), where.stdout
    # its own local Ray cluster (`--address local`): the test session's runs this tree's code
    # (and a knob from the command line, as horovodrun takes it)
    demo = limits.run([str(venv / "bin" / "raytrain-x"), "run", "-np", "2", "--address",
                       "local", "--fusion-threshold-mb", "1", "python", "torch_digits.py",
                       "--epochs", "4"], 20, "the installed demo", ray_starts=1, cwd=work,
                      env=env)
    assert demo.returncode == 0, (demo.stdout[-2000:], demo.stderr[-3000:])
    match = re.search(r"\[0\]<stdout>:test accuracy ([0-9.]+) on 2 workers", demo.stdout)
    assert match and float(match.group(1)) > 0.85, demo.stdout[-2000:]


def test_the_docs_site_builds_with_warnings_as_errors(tmp_path):
    """`make docs`: MkDocs in strict mode fails on a warning, a broken internal link or
    anchor, and a reference entry mkdocstrings cannot render."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = limits.run([str(BIN / "mkdocs"), "build", "--strict", "--site-dir",
                        str(tmp_path / "site")], 30, "mkdocs build --strict", cwd=REPO, env=env)
    assert built.returncode == 0, built.stderr[-4000:]
    for page in ("index.html", "elastic/index.html", "reference/raytrain_x.torch/index.html",
                 "reference/shared/index.html", "changelog/index.html"):
        assert (tmp_path / "site" / page).exists(), page
    torch_page = (tmp_path / "site" / "reference" / "raytrain_x.torch" / "index.html")
    assert "DistributedOptimizer" in torch_page.read_text()
