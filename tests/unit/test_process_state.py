"""This process's state is one object (`core.process.PROCESS`); a new world replaces its
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
        from raytrain_x.core.process import PROCESS

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


def test_no_module_keeps_the_world_s_state_of_its_own():
    """The engine, the sampler, the fixed knobs, the name counters and the elastic record
    live in `PROCESS`, not in module globals of the core and the elastic state."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "raytrain_x"
    for module in ("core/runtime.py", "core/collectives.py", "core/status.py",
                   "elastic/state.py", "comm/rendezvous.py"):
        tree = ast.parse((root / module).read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)], module


def test_no_module_of_the_core_or_the_elastic_state_keeps_an_object_of_its_own():
    """Beside `global` statements, an object made at import and kept as a module global
    (the durable checkpoint counters were one, in `core.status`) is state that outlives
    every world and that no reset sees. `PROCESS` holds it all; loggers, type variables
    and Horovod's `global_process_set` (a name: its members live in the world) are not
    state."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "raytrain_x"
    allowed = {("core/process.py", "PROCESS"), ("core/process_sets.py", "global_process_set")}
    kept = []
    for path in sorted([*root.glob("core/*.py"), *root.glob("elastic/*.py")]):
        module = str(path.relative_to(root))
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or \
                    not isinstance(node.value, ast.Call):
                continue
            made = ast.unparse(node.value.func)
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                name = ast.unparse(target)
                if made not in ("logging.getLogger", "TypeVar") and \
                        (module, name) not in allowed:
                    kept.append(f"{module}: {name} = {made}()")
    assert not kept, kept

