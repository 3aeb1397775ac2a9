"""Every code block of the README and the guides runs, or says why it does not.

The line before each fenced block is a marker:

    <!-- snippet: worker -->      Python run on each rank of a 2-rank world
    <!-- snippet: driver -->      Python run as a driver script on a 2-CPU Ray cluster (the
                                  README's machine's size)
    <!-- snippet: shell -->       commands run by bash in a scratch folder, `raytrain-x`
                                  and `python` from the test environment, that 2-CPU
                                  cluster as RAY_ADDRESS
    <!-- snippet: file NAME -->   a file the page's driver and shell blocks read (written
                                  into their folder first)
    <!-- snippet: covered by tests/integration/test_cli.py::test_ray_job_submit -->
                                  what a named test runs (the test must exist)
    <!-- snippet: text -->        not code: a listing, or what a command prints
    <!-- snippet: ci -->          the set-up commands (`make demo`, `make test`): CI runs
                                  `make test` on a clean clone (`.ci/run`)
    <!-- snippet: not run: needs a real cluster (a cloud account) -->
                                  the reason is a real cluster, a GPU, or Horovod itself

Placeholders the guides leave to the reader (`build()`, `train_fn`, `my_shard_of_the_data`)
come from `tests/doc_names.py`; driver and shell blocks also get `settings` and
`RayExecutor`, and a `train.py` that trains a few steps. All worker blocks run in one
2-rank world and all driver blocks in one driver process, one after another, each in its
own namespace: a block's failure names its page and line.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import limits
from tests.conftest import REPO, TEMP_PREFIX
from tests.workers import run_workers

GUIDES = [Path(REPO) / "README.md",
          *sorted(p for p in (Path(REPO) / "docs").glob("*.md")
                  if p.name not in ("changelog.md", "contributing.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[ \t]*\n(?P<body>.*?)^(?P=indent)```",
                   re.S | re.M)
MARKER = re.compile(r"<!--\s*snippet:\s*(?P<kind>.*?)\s*-->\s*$")
NOT_RUN_REASONS = ("needs a real cluster", "needs a GPU", "needs Horovod")
TRAIN_PY = """\
import raytrain_x.torch as rx
import torch

rx.init()
for step in range(3):
    rx.allreduce(torch.ones(4), name=f"step{step}")
print(f"rank {rx.rank()} done")
"""


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    code: str
    marker: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks() -> list[Block]:
    blocks = []
    for page in GUIDES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            line = text[:m.start()].count("\n") + 1
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = MARKER.search(before)
            indent = m.group("indent")
            code = "\n".join(s[len(indent):] if s.startswith(indent) else s
                             for s in m.group("body").splitlines())
            blocks.append(Block(str(page.relative_to(REPO)), line, m.group("lang"), code,
                                marker.group("kind") if marker else None))
    return blocks


BLOCKS = _blocks()


def _of(kind: str) -> list[Block]:
    return [b for b in BLOCKS if b.marker == kind]


def _files(page: str) -> dict[str, str]:
    return {b.marker.removeprefix("file").strip(): b.code for b in BLOCKS
            if b.page == page and b.marker and b.marker.startswith("file ")}


def test_every_block_is_run_or_says_why_not():
    problems = []
    for b in BLOCKS:
        kind = b.marker
        if kind is None:
            problems.append(f"{b.id}: no <!-- snippet: ... --> marker on the line before")
        elif kind in ("worker", "driver"):
            if b.lang != "python":
                problems.append(f"{b.id}: {kind} blocks are Python, this one is {b.lang!r}")
            else:
                try:
                    ast.parse(b.code)
                except SyntaxError as exc:
                    problems.append(f"{b.id}: not valid Python: {exc}")
        elif kind in ("shell", "text") or kind.startswith("file "):
            pass
        elif kind == "ci":
            commands = {line.split("#")[0].strip() for line in b.code.splitlines()}
            if not commands <= {"make demo", "make test", ""} or "make test" not in (
                    Path(REPO) / ".ci" / "run").read_text():
                problems.append(f"{b.id}: 'ci' is for the set-up commands CI runs")
        elif kind.startswith("covered by"):
            path, _, name = kind.removeprefix("covered by").strip().partition("::")
            source = Path(REPO) / path
            if not name or not source.exists() or not re.search(
                    rf"^def {re.escape(name)}\(", source.read_text(), re.M):
                problems.append(f"{b.id}: {kind!r} names no test")
        elif kind.startswith("not run:"):
            if not any(reason in kind for reason in NOT_RUN_REASONS):
                problems.append(f"{b.id}: 'not run' may say only {NOT_RUN_REASONS}")
        else:
            problems.append(f"{b.id}: unknown marker {kind!r}")
    assert not problems, "\n".join(problems)
    assert _of("worker") and _of("driver") and _of("shell")


def _worker_blocks(blocks: list[tuple[str, str]], folder: str) -> dict[str, str]:
    """Every worker block on one rank, each in its own namespace; the failures by block."""
    import traceback

    from tests import doc_names

    os.chdir(folder)
    failed = {}
    for name, code in blocks:
        namespace = {"__name__": "__snippet__", **vars(doc_names)}
        try:
            exec(compile(code, name, "exec"), namespace)  # noqa: S102 - the guide's code
        except BaseException:  # noqa: BLE001 - reported by the test
            failed[name] = traceback.format_exc(limit=-3)
    return failed


def test_worker_blocks_run(tmp_path):
    blocks = [(b.id, b.code) for b in _of("worker")]
    for rank, failed in enumerate(run_workers(_worker_blocks, 2, blocks, str(tmp_path),
                                              work_s=10 + 3 * len(blocks))):
        assert not failed, f"rank {rank}:\n" + "\n".join(f"{k}:\n{v}" for k, v in
                                                        failed.items())


_DRIVER = """\
import json, os, traceback
import ray

_init = ray.init
def _once(*args, **kwargs):  # a guide's ray.init() after another's: the same cluster
    if ray.is_initialized():
        return None
    return _init(*args, **kwargs)
ray.init = _once

from raytrain_x.ray import RayExecutor
NAMES = open({names!r}).read()
failed = {{}}
for name, code, folder in json.load(open({blocks!r})):
    os.chdir(folder)
    namespace = {{"__name__": "__main__"}}
    try:
        exec(compile(NAMES, "tests/doc_names.py", "exec"), namespace)
        namespace["RayExecutor"] = RayExecutor
        namespace["settings"] = RayExecutor.create_settings(timeout_s=30)
        exec(compile(code, name, "exec"), namespace)
    except BaseException:
        failed[name] = traceback.format_exc(limit=-4)
print("FAILED " + json.dumps(failed))
"""


def _folder(tmp_path: Path, block: Block) -> str:
    folder = tmp_path / re.sub(r"\W", "_", block.id)
    folder.mkdir()
    (folder / "train.py").write_text(TRAIN_PY)
    (folder / "examples").symlink_to(Path(REPO) / "examples")
    for name, content in _files(block.page).items():
        (folder / name).write_text(content)
    return str(folder)


def _env(address: str) -> dict[str, str]:
    return {**os.environ, "RAY_ADDRESS": address, "RAY_AUTH_MODE": "disabled",
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "PYTHONPATH": REPO}


@pytest.fixture(scope="module")
def readme_sized_cluster():
    """A Ray cluster the size of the README's machine, 2 CPUs, for the guides' driver and
    shell blocks: the session's cluster has 8 logical CPUs, on which a Tune trial asking 3
    CPUs ran, and hung on a user's 2-core machine. Stopped, whatever happens."""
    from raytrain_x.testing.processes import cluster_processes, stop
    from raytrain_x.testing.waiting import free_port

    port = free_port()
    temp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}doc", dir="/tmp"))  # short socket paths
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    try:
        start = limits.run(
            [str(Path(sys.executable).parent / "ray"), "start", "--head", f"--port={port}",
             "--num-cpus=2", "--include-dashboard=false", f"--temp-dir={temp}",
             f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
             f"--dashboard-agent-listen-port={free_port()}",
             f"--dashboard-agent-grpc-port={free_port()}", "--disable-usage-stats"],
            10, "a 2-CPU cluster for the guides' blocks", ray_starts=1, env=env)
        assert start.returncode == 0, start.stderr[-2000:]
        yield f"127.0.0.1:{port}"
    finally:
        stop(cluster_processes([str(temp), f":{port} "]))
        shutil.rmtree(temp, ignore_errors=True)


def test_driver_blocks_run(readme_sized_cluster, tmp_path):
    blocks = [(b.id, b.code, _folder(tmp_path, b)) for b in _of("driver")]
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    script = _DRIVER.format(names=str(Path(REPO) / "tests" / "doc_names.py"),
                            blocks=str(tmp_path / "blocks.json"))
    # a home of its own: Ray Tune writes its results under ~/ray_results by default
    out = limits.run([sys.executable, "-c", script], 30 + 6 * len(blocks),
                     "the guides' driver blocks",
                     env={**_env(readme_sized_cluster), "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    failed = json.loads(out.stdout.rsplit("FAILED ", 1)[1])
    assert not failed, "\n".join(f"{k}:\n{v}" for k, v in failed.items())


def test_shell_blocks_run(readme_sized_cluster, tmp_path):
    for block in _of("shell"):
        script = "set -euo pipefail\n" + textwrap.dedent(block.code)
        out = limits.run(["bash", "-c", script], 30, f"the shell block {block.id}",
                         cwd=_folder(tmp_path, block), env=_env(readme_sized_cluster))
        assert out.returncode == 0, (block.id, out.stdout[-2000:], out.stderr[-3000:])
