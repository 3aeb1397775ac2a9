"""The chaos soak's discovery outage (`tools/chaos.py`): the script it gives the job, run by
the product's own `ScriptDiscovery`, reports the cluster's worker nodes, fails or hangs
while the outage lasts and reports them again after it; and the soak's judge counts an
outage as ridden out at the first step after it began (the job trains on with the hosts it
has), not at a round it never needs."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from raytrain_x.common.errors import ConfigError
from raytrain_x.ray.elastic.discovery import ScriptDiscovery

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _chaos():
    spec = importlib.util.spec_from_file_location("chaos_tool", TOOLS / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("chaos_tool", module)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class _Node:
    node_id: str


class _Nodes:
    slots = 2

    def __init__(self) -> None:
        self.nodes = [_Node("a" * 56), _Node("b" * 56)]

    def hosts(self) -> list[_Node]:
        return list(self.nodes)


def test_the_outage_script_fails_hangs_and_recovers(tmp_path):
    chaos = _chaos()
    nodes = _Nodes()
    script = chaos.DiscoveryScript(str(tmp_path), nodes)
    # a run that answers gets all the time a loaded machine needs; the hung one is given up
    # on after half a second (it would hang until the outage ends)
    discovery = ScriptDiscovery(str(script.path), timeout_s=30)
    impatient = ScriptDiscovery(str(script.path), timeout_s=0.5)
    assert discovery.run_once() == {"a" * 56: 2, "b" * 56: 2}

    nodes.nodes.append(_Node("c" * 56))  # a fresh node joins: the next refresh lists it
    script.refresh()
    assert discovery.run_once() == {n.node_id: 2 for n in nodes.nodes}

    script.take_down("fail")
    assert script.is_down()
    failed = discovery.run_once()
    assert isinstance(failed, ConfigError) and "exited with 3" in str(failed)

    script.take_down("hang")
    hung = impatient.run_once()
    assert isinstance(hung, ConfigError) and "did not finish" in str(hung)

    script.bring_up()
    assert not script.is_down()
    assert discovery.run_once() == {n.node_id: 2 for n in nodes.nodes}


def test_an_outage_is_ridden_out_at_the_next_step_without_a_round():
    chaos = _chaos()
    # (t, step, size, round): the job trains through the outage in round 3
    samples = [(0.0, 10, 4, 3), (1.0, 11, 4, 3), (2.0, 12, 4, 3), (9.0, 20, 4, 3)]
    job = {"index": 0, "samples": samples, "errors": [], "events": [], "below": [],
           "ended": 10.0, "outcome": "finished", "restores_seen": []}
    outage = {"kind": "discovery_outage", "t": 1.5, "end": 8.0, "host": "fail"}
    [judged] = chaos._judge(job, [outage], began=0.0, respawn_s=3.0)
    assert judged["recovery_s"] == 0.5  # the first step after it began, in the same round
    assert job["errors"] == []
