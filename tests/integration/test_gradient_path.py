"""The modules a gradient of `DistributedOptimizer` runs through, from its hook until
`step()` returns, are the ones docs/architecture.md draws ("A gradient's way from its hook
to the wire"): a module added to the path, or one that left it, fails here until the
drawing says so."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tests.workers import run_workers

ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
HEADING = "## A gradient's way from its hook to the wire"
# the drawing's common path ends at this line; modules below it run only where they apply
WHERE_IT_APPLIES = "only where it applies:"
THREADS = ("MainThread", "raytrain-x-engine")  # the face's thread and the engine's


def _traced_step() -> tuple[list[str], int]:
    """The package's modules whose functions run, on the face's thread and the engine's,
    during one warm step of the default `DistributedOptimizer` (every gradient through it),
    and how many pieces crossed a network in that step."""
    import sys
    import threading

    import raytrain_x.torch as rx
    from raytrain_x.core import runtime

    seen: set[str] = set()
    recording = False

    def profile(frame, event, arg) -> None:
        if recording and event == "call" and threading.current_thread().name in THREADS:
            module = frame.f_globals.get("__name__", "")
            if module.startswith("raytrain_x."):
                seen.add(module)

    threading.setprofile(profile)  # the engine's thread starts in init()
    sys.setprofile(profile)
    try:
        rx.init()
        torch.manual_seed(0)
        # units under 1 MB and over it: over gloo, both the flat route and the in-flight
        # one (in pieces on the stream) run
        model = torch.nn.Sequential(torch.nn.Linear(64, 600), torch.nn.Linear(600, 600),
                                    torch.nn.Linear(600, 600), torch.nn.Linear(600, 64),
                                    torch.nn.Linear(64, 64))
        opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                      named_parameters=model.named_parameters())
        x = torch.randn(8, 64)

        def step() -> None:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        for _ in range(5):  # past the first negotiations: the response cache answers
            step()
        pieces = runtime.engine().stats.in_flight_pieces
        recording = True
        step()
        recording = False
        pieces = runtime.engine().stats.in_flight_pieces - pieces
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return sorted(seen), pieces


def _drawn() -> tuple[set[str], set[str], int]:
    """The drawing's modules on the common path, those where they apply, and the count
    its text gives."""
    text = ARCHITECTURE.read_text()
    section = text[text.index(HEADING):]
    section = section[:section.index("\n## ", 1)]
    block = section.split("```")[1]
    common, _, applies = block.partition(WHERE_IT_APPLIES)

    def modules(part: str) -> set[str]:
        return {"raytrain_x." + m.replace("/", ".")
                for m in re.findall(r"\b((?:torch|core|engine|comm|common)/[a-z_]+)\.py", part)}
    count = re.search(r"crosses (\d+) modules", section)
    assert count, "the drawing's text says how many modules the common path crosses"
    return modules(common), modules(applies), int(count.group(1))


def test_the_drawing_names_every_module_a_gradient_runs_through():
    traced = set()
    for env in ({}, {"RAYTRAIN_X_SHM": "0"}):  # shared memory on one host; gloo, as between hosts
        for rank_modules, pieces in run_workers(_traced_step, 2, env=env, work_s=30):
            traced |= set(rank_modules)
            if env:  # the units of 1 MB or more crossed gloo in pieces
                assert pieces > 0
    common, applies, count = _drawn()
    assert not traced - common - applies, \
        f"on the path but not in docs/architecture.md's drawing: " \
        f"{sorted(traced - common - applies)}"
    assert not common - traced, \
        f"drawn on the common path but not run by a step: {sorted(common - traced)}"
    assert count == len(common), f"the drawing says {count} modules; it lists {len(common)}"
