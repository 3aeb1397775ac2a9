"""The package a user installs: the wheel `make wheel` builds, installed (not editable) into
a clean virtual environment, runs the torch demo outside the source tree; and the docs site
builds with warnings as errors and every internal link resolved."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from tests import background, limits
from tests.conftest import REPO as _REPO

BIN = Path(sys.executable).parent
REPO = Path(_REPO)


def _sources() -> list[str]:
    """Where pip is configured to look, as uv options (what `make` passes uv)."""
    out = subprocess.run([sys.executable, str(REPO / "requirements" / "pip_sources.py")],
                         capture_output=True, text=True, check=True).stdout
    return shlex.split(out)


_WHEEL_DIR = Path(tempfile.mkdtemp(prefix="wheel", dir=os.environ.get("TMPDIR")))
_VENV = _WHEEL_DIR / "venv"
background.register("wheel-venv", ["bash", "-c", "set -euo pipefail\n" + "\n".join([
    shlex.join([str(BIN / "uv"), "build", "--wheel", "--no-build-isolation", "--python",
                sys.executable, "--out-dir", str(_WHEEL_DIR / "dist"), str(REPO)]),
    shlex.join([sys.executable, "-m", "venv", "--without-pip", str(_VENV)]),
    shlex.join([str(BIN / "uv"), "pip", "install", "--python", str(_VENV / "bin" / "python"),
                "-c", str(REPO / "requirements" / "dev-constraints.txt"), *_sources()])
    + ' "$(ls ' + shlex.quote(str(_WHEEL_DIR / "dist")) + '/raytrain_x-*.whl)[torch,examples]"',
])], cwd=REPO)


@pytest.mark.background("wheel-venv")
def test_the_wheel_installs_and_runs_the_demo_outside_the_source_tree(tmp_path):
    """The wheel is built and installed into a clean venv beside the other tests from the
    start of the session (tests/background.py); the demo runs here."""
    built = background.result("wheel-venv", work_s=60)
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = (_WHEEL_DIR / "dist").glob("raytrain_x-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for shipped in ("raytrain_x/py.typed", "raytrain_x/tensorflow/csrc/async_kernel.cc"):
        assert shipped in names
    assert any(n.startswith("raytrain_x/_native.") and n.endswith(".so") for n in names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    venv = _VENV

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


_SITE = Path(tempfile.mkdtemp(prefix="site", dir=os.environ.get("TMPDIR"))) / "site"
background.register("docs-site", [str(BIN / "mkdocs"), "build", "--strict", "--site-dir",
                                  str(_SITE)],
                    cwd=REPO, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.mark.background("docs-site")
def test_the_docs_site_builds_with_warnings_as_errors():
    """`make docs`: MkDocs in strict mode fails on a warning, a broken internal link or
    anchor, and a reference entry mkdocstrings cannot render (built beside the other tests
    from the start of the session, tests/background.py)."""
    built = background.result("docs-site", work_s=30)
    assert built.returncode == 0, built.stderr[-4000:]
    for page in ("index.html", "elastic/index.html", "reference/raytrain_x.torch/index.html",
                 "reference/shared/index.html", "changelog/index.html"):
        assert (_SITE / page).exists(), page
    torch_page = _SITE / "reference" / "raytrain_x.torch" / "index.html"
    assert "DistributedOptimizer" in torch_page.read_text()
