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
