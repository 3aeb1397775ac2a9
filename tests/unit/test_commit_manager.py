"""The commit manager owns the elastic state's commits: the faces give it a format and reach
into nothing else, and only the driver decides whether a round restores from storage."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.limits import limit

ROOT = Path(__file__).resolve().parents[2] / "raytrain_x"

# what the commit manager owns: a state's, a face's or another module's reach into these on
# an object other than `self` is a second writer of the commit state
COMMIT_INTERNALS = {"_commits", "_durable", "_committed", "_saved", "_saved_values",
                    "_values", "_load_tree", "_shards", "_format", "_names", "_snapshots"}


def test_no_module_reaches_into_another_objects_commit_state():
    """Before the commit manager the faces' durable modules read `state._commits`,
    `state._values()`, `state._load_tree` and `state._saved_values`: four owners of one
    commit."""
    reaches = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in COMMIT_INTERNALS and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                reaches.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert not reaches, reaches


def test_the_commit_number_is_written_by_the_commit_manager_alone():
    writers = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AugAssign) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr == "number" and \
                        path.name not in ("commits.py", "checkpoints.py"):
                    writers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    # the simulator's virtual workers count their own commits
    assert all(w.startswith("testing/simulation/") for w in writers), writers


def _rdv(**kw):
    from raytrain_x.comm.rendezvous import Rendezvous

    return Rendezvous(**kw)


@pytest.mark.parametrize("told, state_round, expected", [
    # an elastic round: only what the driver said counts, whatever this rank holds
    ({"elastic": True}, 0, None),
    ({"elastic": True}, 3, None),
    ({"elastic": True, "restore_from_storage": True, "restore_checkpoint": [2, 40]}, 3,
     (2, 40)),
    ({"elastic": True, "restore_from_storage": True}, 0, "latest"),
    # a name without the word to restore is not a restore
    ({"elastic": True, "restore_checkpoint": [2, 40]}, 0, None),
    # a fixed world: the job's start restores the latest, and nothing after it
    ({}, 0, "latest"),
    ({}, 1, None),
])
def test_a_round_restores_from_storage_only_as_its_driver_decided(told, state_round, expected):
    from raytrain_x.elastic.durable import restore_decision

    assert restore_decision(_rdv(**told), state_round) == expected


def test_the_driver_names_the_checkpoint_every_worker_of_a_round_restores():
    from raytrain_x.ray.elastic.rounds import plan_round

    members = {"a": ("n1", 0), "b": ("n2", 1)}
    places = plan_round(members, 5, 1, (), True, [3, 17])
    assert all(p["restore_from_storage"] and p["restore_checkpoint"] == [3, 17]
               and p["elastic"] for p in places.values())
    kept = plan_round(members, 6, 1, ["a"], False, None)
    assert not any(p["restore_from_storage"] or p["restore_checkpoint"]
                   for p in kept.values())
    _rdv(**{k: v for k, v in places["a"].items()}, store=object())  # a worker takes it


def _run(code: str) -> None:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=limit(120))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), \
        out.stdout[-2000:] + out.stderr[-3000:]


def test_a_torch_state_commits_rolls_back_and_syncs_through_its_manager():
    """One process, a world of one: the number counts commits (the sync ends with one),
    a rollback loads the committed copy (models, optimizers, samplers, attributes), and
    the copy is the manager's."""
    _run("""
        import torch
        from raytrain_x.core import runtime
        import raytrain_x.torch as rx

        runtime.start()
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sampler = rx.elastic.ElasticSampler(list(range(10)), shuffle=False)
        state = rx.elastic.TorchState(model, opt, sampler=sampler, epoch=0, note="a")
        commits = state._commits
        assert commits.number == 0 and commits.durable is None
        state.sync()
        assert commits.number == 1
        model(torch.ones(4, 3)).sum().backward()
        opt.step()
        sampler.record_batch(0, 2)
        state.epoch, state.note = 1, "b"
        state.commit()
        assert commits.number == 2
        kept = {k: v.clone() for k, v in model.state_dict().items()}
        momentum = opt.state_dict()["state"][0]["momentum_buffer"].clone()
        model(torch.ones(4, 3)).sum().backward()
        opt.step()
        sampler.record_batch(1, 2)
        state.epoch, state.note = 2, "c"
        state.restore()
        assert all(torch.equal(model.state_dict()[k], v) for k, v in kept.items())
        assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], momentum)
        assert sampler.processed_indices == {0, 1} and (state.epoch, state.note) == (1, "b")
        committed = commits.committed().tree()
        assert committed["attributes"] == {"epoch": 1, "note": "b"}
        assert commits.number == 2  # a rollback counts nothing
        runtime.shutdown()
        print("ok")
    """)


def test_an_object_state_is_the_same_manager_over_its_attributes():
    _run("""
        from raytrain_x.core import runtime
        from raytrain_x.elastic import ObjectState

        runtime.start()
        state = ObjectState(epoch=0, seen=[1])
        state.sync()
        state.epoch = 4
        state.seen.append(2)
        state.commit()
        state.epoch = 9
        state.seen.append(3)
        state.restore()
        assert (state.epoch, state.seen) == (4, [1, 2]), (state.epoch, state.seen)
        assert state._commits.number == 2 and state._commits.format.layout == "objects"
        runtime.shutdown()
        print("ok")
    """)


def test_user_attributes_take_any_name_but_the_states_methods():
    """Horovod's elastic test script builds `TorchState(model, optimizer, batch=0, epoch=0,
    commits=0, rendezvous=0)`: `commits` was the state's commit manager, and the first commit
    ended in `TypeError: cannot pickle '_thread.lock' object` from inside `copy.deepcopy`.
    Its attributes now take any name; one that is a method of the state is refused, named;
    Horovod's `state._host_messages.empty()` answers (no driver: empty)."""
    _run("""
        import torch
        from raytrain_x.common.errors import ConfigError
        from raytrain_x.core import runtime
        import raytrain_x.torch as rx

        runtime.start()
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = rx.elastic.TorchState(model, opt, batch=0, epoch=0, commits=0, rendezvous=0)
        state.sync()
        state.commits += 1
        state.rendezvous += 1
        state.commit()
        state.commits, state.rendezvous = 5, 7
        state.restore()
        assert (state.commits, state.rendezvous) == (1, 1), (state.commits, state.rendezvous)
        assert state._host_messages.empty()
        for bad, said in [({"commit": 0}, "'commit' is TorchState.commit"),
                          ({"restored_from": 1}, "'restored_from' is TorchState.restored_from"),
                          ({"_format": 1}, "names that start with '_'")]:
            for make in (lambda: rx.elastic.TorchState(model, opt, **bad),
                         lambda: rx.elastic.ObjectState(**bad)):
                try:
                    make()
                except ConfigError as exc:
                    kind = "TorchState" if "TorchState" in str(exc) else "ObjectState"
                    assert said.replace("TorchState", kind) in str(exc), exc
                else:
                    raise AssertionError(f"{bad} was taken")
        runtime.shutdown()
        print("ok")
    """)


def test_commits_in_the_background_are_refused_for_a_state_without_an_fsdp2_model():
    import torch

    import raytrain_x.torch as rx

    model = torch.nn.Linear(2, 2)
    with pytest.raises(rx.ConfigError, match="commit_in_background applies to a model "
                                             "sharded by fully_shard"):
        rx.elastic.TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              commit_in_background=True)
