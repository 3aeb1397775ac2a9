"""This process's state is one object (`common.process.PROCESS`); a new world replaces its
`world` whole, so an elastic reset leaves nothing of the round before behind."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.limits import limit


def test_a_new_world_replaces_the_last_whole_and_numbers_unnamed_collectives_from_0():
    """A worker that joins a running job and the veterans must name the round's unnamed
    collectives alike: each world counts them from 0 (counted per process before, a
    newcomer's first unnamed allreduce was the veterans' 7th, and both sides waited)."""
    code = textwrap.dedent("""
        from raytrain_x.core import collectives, runtime
        from raytrain_x.common.process import PROCESS

        runtime.start()
        first = PROCESS.world
        names = [collectives.auto_name("allreduce") for _ in range(3)]
        assert names[-1] == "allreduce.noname.2", names
        runtime.mark_step()
        runtime.shutdown()
        assert PROCESS.world is None and not runtime.is_initialized()
        runtime.start()
        assert PROCESS.world is not first and PROCESS.world.engine is not first.engine
        assert collectives.auto_name("allreduce") == "allreduce.noname.0"
        assert runtime.step_clock().steps == 1  # the process's own record stays
        runtime.shutdown()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=limit(60))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


# Module-level objects made at import that are not state: what makes them (loggers, type
# variables, a package's `__getattr__` and `__dir__`), and by module and name, each with why
MAKERS_OF_CONSTANTS = {"logging.getLogger", "progress_logger", "TypeVar", "lazy_names"}
NOT_STATE = {
    ("core/process_sets.py", "global_process_set"): "a name: its members live in the world",
    ("torch/mpi_ops.py", "_basics"): "Horovod's `_basics`: reads the runtime, holds nothing",
    ("tensorflow/keras/__init__.py", "elastic"): "a module, under Horovod's name",
    ("ray/worker.py", "Worker"): "the worker's Ray actor class",
    ("comm/backend.py", "_backends"): "the backends' classes, registered at import (code)",
    ("engine/arrays.py", "_by_type"): "the array types' operations (code)",
    ("engine/arrays.py", "_families"): "the array types' operations (code)",
    ("elastic/storage_schemes.py", "_SCHEMES"): "storage backends by scheme (code)",
}


def _module_objects(root):
    """(module, name, what made it) of every module-level object made at import (a call,
    or a dict, list or set) under a name not in capitals (capitals: a constant), and the
    modules with a `global` statement, in every module but the test harness's."""
    import ast

    made, with_global = [], []
    for path in sorted(root.rglob("*.py")):
        module = str(path.relative_to(root))
        if module.startswith("testing/"):  # the harness: test and benchmark drivers
            continue
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.Global) for n in ast.walk(tree)):
            with_global.append(module)
        for node in tree.body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or not isinstance(
                    node.value, (ast.Call, ast.Dict, ast.List, ast.Set, ast.DictComp,
                                 ast.ListComp, ast.SetComp)):
                continue
            maker = ast.unparse(node.value.func) if isinstance(node.value, ast.Call) else \
                type(node.value).__name__
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                name = ast.unparse(target)
                if not name.startswith("__") and (not name.lstrip("_").isupper() or
                                                  _changed(tree, name)):
                    made.append((module, name, maker))
    return made, with_global


MUTATORS = {"append", "add", "update", "pop", "clear", "extend", "setdefault", "remove",
            "discard", "popitem", "insert"}


def _changed(tree, name: str) -> bool:
    """Whether the module changes the object `name` names (an item set, an operator
    assignment to an item, a mutating method): named in capitals, it is state all the
    same."""
    import ast

    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Subscript) and ast.unparse(target.value) == name:
                    return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in MUTATORS and ast.unparse(node.func.value) == name:
            return True
    return False


def test_no_module_keeps_state_of_its_own():
    """`PROCESS` holds everything raytrain-x keeps in a process (the engine, counters,
    servers, sinks, the TensorFlow kernels); no module of the package keeps an object of
    its own between calls, nor rebinds a global. What a module makes at import is a
    constant (named in capitals), a logger, or code (`NOT_STATE`, each with why). Kept in a
    module, the durable checkpoint counters, the stores a rank serves and the numbering of
    optimizers built without names outlived every world unseen by a reset."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "raytrain_x"
    made, with_global = _module_objects(root)
    assert made, "no module-level objects found: the test no longer sees them"
    kept = [f"{m}: {n} = {k}" for m, n, k in made
            if k not in MAKERS_OF_CONSTANTS and (m, n) not in NOT_STATE]
    assert not kept, kept
    assert not with_global, with_global
    assert all((m, n) in {(m, n) for m, n, _ in made} for m, n in NOT_STATE), \
        "NOT_STATE names an object that is gone: drop it"


def test_the_process_state_imports_nothing_above_common_when_it_runs():
    """`common.process` sits at the bottom so that every layer can keep its state in it;
    it names the engine's, the sampler's and the rendezvous' types in annotations alone
    (the layer contracts ignore those imports, pyproject.toml)."""
    code = ("import sys, raytrain_x.common.process; "
            "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('raytrain_x.')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=limit(60))
    assert out.returncode == 0 and out.stdout.strip() == "['common']", \
        (out.stdout, out.stderr[-2000:])
