"""Sharded optimizer state (`zero_stage=1`) and gradients (`zero_stage=2`): the same
weights as the unsharded optimizer on the same data, in real gloo worlds of 2 and 3 ranks
(uneven shards), and a full state dict that loads across stages and world sizes."""

from __future__ import annotations

import pytest
import torch

from tests.workers import run_workers


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5),
                               torch.nn.Tanh(), torch.nn.Linear(5, 3))


class _MomentumOfItsOwn(torch.optim.SGD):
    """An optimizer class from outside torch.optim (stepped whole, after every reduction;
    torch's own step each bucket as its reduction lands)."""


def _make(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    first, rest = list(model[0].parameters()), [p for m in model[1:]
                                                 for p in m.parameters()]
    groups = [{"params": first, "lr": 0.05}, {"params": rest}]  # two groups, two lrs
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    if kind == "own":
        return _MomentumOfItsOwn(groups, lr=0.1, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=0.01)
    return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1)


def _train(rx, kind: str, stage: int, steps: int, passes: int) -> dict:
    model = _model()
    opt = rx.DistributedOptimizer(_make(kind, model), named_parameters=model.named_parameters(),
                                  zero_stage=stage, backward_passes_per_step=passes,
                                  bucket_cap_mb=0.001)  # several buckets of a tiny model
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    g = torch.Generator().manual_seed(10 + rx.rank())  # each rank its own data
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(passes):
            x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
            (torch.nn.functional.cross_entropy(model(x), y) / passes).backward()
        opt.step()
        sched.step()
    state = opt.state_dict()  # consolidated: every rank calls it
    return {"weights": {k: v.clone() for k, v in model.state_dict().items()},
            "state_keys": sorted(state["state"]),
            "lrs": [group["lr"] for group in state["param_groups"]],
            "moments": {i: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
                        for i, s in state["state"].items()}}


def _every_way(runs: list[tuple[str, int, int, int]]) -> dict:
    """Each (optimizer, stage, steps, backward passes) trained in turn in one world."""
    import raytrain_x.torch as rx

    rx.init()
    return {run: _train(rx, *run) for run in runs}


def _check_same(reference: dict, out: dict, where: str) -> None:
    for name, value in reference["weights"].items():
        torch.testing.assert_close(out["weights"][name], value, rtol=1e-5, atol=1e-6,
                                   msg=f"{where} {name}")
    assert out["state_keys"] == reference["state_keys"], where
    assert out["lrs"] == reference["lrs"], where
    for index, moments in reference["moments"].items():
        for key, value in moments.items():
            torch.testing.assert_close(out["moments"][index][key], value, rtol=1e-5,
                                       atol=1e-6, msg=f"{where} state {index} {key}")


@pytest.mark.parametrize("size,transport", [(2, "shm"), (3, "gloo")])
def test_stages_1_and_2_train_to_the_unsharded_weights(size, transport):
    """SGD with momentum, Adam and AdamW, two param groups, an lr scheduler, 20 steps (and
    Adam with 3 backward passes a step, and a class of the user's own, 6 steps): stages 1
    and 2 end at stage 0's weights on every
    rank, and their consolidated state equals stage 0's; reduce-scatters and in-place
    allgathers through shared memory, or through gloo."""
    runs = [(kind, stage, 20, 1) for kind in ("sgd", "adam", "adamw") for stage in (0, 1, 2)]
    runs += [("adam", stage, 6, 3) for stage in (0, 1, 2)]
    runs += [("own", stage, 6, 1) for stage in (0, 1, 2)]
    env = {"RAYTRAIN_X_SHM": "1" if transport == "shm" else "0"}
    results = run_workers(_every_way, size, runs, env=env, work_s=40)
    for kind, stage, steps, passes in runs:
        if stage:
            for rank, out in enumerate(results):
                _check_same(results[0][(kind, 0, steps, passes)],
                            out[(kind, stage, steps, passes)],
                            f"{kind} stage {stage} passes {passes} rank {rank}")


def _round_trip() -> dict:
    import raytrain_x.torch as rx

    rx.init()
    model = _model()
    sharded = rx.DistributedOptimizer(_make("adam", model), zero_stage=2)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    sharded.step()
    full = sharded.state_dict()
    # into an unsharded optimizer, and back into one of stage 1
    plain = _make("adam", model)
    plain.load_state_dict(full)
    again = rx.DistributedOptimizer(_make("adam", model), zero_stage=1)
    again.load_state_dict(plain.state_dict())
    return {"full": len(full["state"]), "params": sum(1 for _ in model.parameters()),
            "equal": all(torch.equal(again.state_dict()["state"][i]["exp_avg"],
                                     full["state"][i]["exp_avg"]) for i in full["state"])}


def _one_step(rx, opt: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    """The same batch on every rank, so the averaged gradient is the batch's own."""
    opt.zero_grad()
    x = torch.linspace(-1, 1, 32).reshape(4, 8)
    torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2, 0])).backward()
    opt.step()


def _save_in_a_world() -> dict:
    """Two steps of a sharded Adam; the full state and the weights."""
    import raytrain_x.torch as rx

    rx.init()
    model = _model()
    opt = rx.DistributedOptimizer(_make("adam", model), zero_stage=2)
    for _ in range(2):
        _one_step(rx, opt, model)
    return {"state": opt.state_dict(), "weights": model.state_dict()}


def _load_in_another_world(saved: dict) -> dict:
    """The saved state and weights into stage 1 in this world, and into an unsharded Adam
    in this process alone; one more step of each."""
    import copy

    import raytrain_x.torch as rx

    rx.init()
    out = {}
    for way in ("sharded", "plain"):
        model = _model()
        model.load_state_dict(saved["weights"])
        inner = _make("adam", model)
        opt = (rx.DistributedOptimizer(inner, zero_stage=1) if way == "sharded" else inner)
        # a copy each: torch's optimizers take a loaded tensor as their own and step it in
        # place, and these came through shared memory from the saving world
        opt.load_state_dict(copy.deepcopy(saved["state"]))
        _one_step(rx, opt, model)
        state = opt.state_dict()
        out[way] = {"weights": {k: v.clone() for k, v in model.state_dict().items()},
                    "state_keys": sorted(state["state"]),
                    "lrs": [group["lr"] for group in state["param_groups"]],
                    "moments": {i: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
                                for i, s in state["state"].items()}}
    return out


def test_the_state_dict_is_the_full_state_and_loads_across_stages():
    for out in run_workers(_round_trip, 3, work_s=20):
        assert out["full"] == out["params"] and out["equal"]


def test_a_state_saved_by_3_ranks_loads_into_2_and_trains_on_as_unsharded():
    """Saved by stage 2 on 3 ranks (uneven shards), loaded by stage 1 on 2: the next step
    equals an unsharded Adam's from the same state, on each rank."""
    saved = run_workers(_save_in_a_world, 3, work_s=20)
    assert sorted(saved[0]["state"]["state"]) == list(range(6))  # the whole state
    for rank, out in enumerate(run_workers(_load_in_another_world, 2, saved[0], work_s=20)):
        _check_same(out["plain"], out["sharded"], f"loaded on rank {rank}")


def _clipped() -> dict:
    """Stage 0 clipped by torch and stage 2 by its own clip_grad_norm_, same data."""
    import raytrain_x.torch as rx

    rx.init()
    out = {}
    for stage in (0, 2):
        model = _model()
        opt = rx.DistributedOptimizer(_make("sgd", model), zero_stage=stage,
                                      named_parameters=model.named_parameters())
        g = torch.Generator().manual_seed(rx.rank())
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        norm = (torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05) if stage == 0
                else opt.clip_grad_norm_(0.05))
        with opt.skip_synchronize():
            opt.step()
        out[stage] = (float(norm), {k: v.clone() for k, v in model.state_dict().items()})
    return out


def test_clipping_by_the_total_norm_matches_torch_on_unsharded_gradients():
    for out in run_workers(_clipped, 2, work_s=10):
        assert out[2][0] == pytest.approx(out[0][0], rel=1e-6)
        for name, value in out[0][1].items():
            torch.testing.assert_close(out[2][1][name], value, rtol=1e-5, atol=1e-6)


def _bad(arguments: list[dict]) -> list[str]:
    import raytrain_x.torch as rx

    rx.init()
    model = torch.nn.Linear(2, 2)
    messages = []
    for argument in arguments:
        try:
            rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **argument)
            messages.append("no error")
        except rx.ConfigError as exc:
            messages.append(str(exc))
    return messages


def _elastic_bad_replicas() -> list[str]:
    import raytrain_x.torch as rx

    rx.init()
    model = torch.nn.Linear(2, 2)
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), zero_stage=1)
    messages = []
    for replicas in (0, "2"):
        try:
            rx.elastic.TorchState(model, opt, replicas=replicas)
            messages.append("no error")
        except rx.ConfigError as exc:
            messages.append(str(exc))
    return messages


def test_elastic_state_of_a_sharded_optimizer_takes_a_count_of_replicas():
    for message in run_workers(_elastic_bad_replicas, 1, work_s=10)[0]:
        assert "replicas must be an int >= 1" in message


BAD = [({"zero_stage": 3}, "zero_stage=3 shards the parameters too: shard the model with "
                         "torch's fully_shard"),
       ({"zero_stage": 4}, "zero_stage must be 0, 1 or 2"),
       ({"zero_stage": 1, "op": "adasum"}, "not rx.Adasum"),
       ({"zero_stage": 2, "groups": 2}, "leave groups out"),
       ({"zero_stage": 1, "bucket_cap_mb": 0}, "bucket_cap_mb must be > 0")]


def test_bad_arguments_are_one_line_errors():
    messages = run_workers(_bad, 1, [argument for argument, _ in BAD], work_s=10)[0]
    for (argument, expected), message in zip(BAD, messages):
        assert expected in message and "\n" not in message, (argument, message)


def _default_stage() -> list:
    import raytrain_x.torch as rx
    from raytrain_x.torch.zero_optimizer import ShardedOptimizer

    rx.init()
    model = torch.nn.Linear(2, 2)
    chosen = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    given = rx.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(),
                                                    lr=0.1), zero_stage=0)
    return [isinstance(chosen, ShardedOptimizer) and chosen.zero_stage,
            isinstance(given, ShardedOptimizer)]


def test_a_config_files_zero_stage_is_the_default():
    """`raytrain-x run --config-file` and the trainer hand a config file's zero_stage to the
    workers (RAYTRAIN_X_ZERO_STAGE); an explicit argument still wins."""
    env = {"RAYTRAIN_X_ZERO_STAGE": "2"}
    assert run_workers(_default_stage, 1, env=env, work_s=10)[0] == [2, False]


def _implementations() -> dict:
    import raytrain_x.torch as rx

    rx.init()
    out = {}
    for name, settings in (("unset", {}), ("foreach", {"foreach": True}),
                           ("not fused", {"fused": False})):
        model = _model()
        opt = rx.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01,
                                                        **settings), zero_stage=1)
        _one_step(rx, opt, model)
        _one_step(rx, opt, model)
        out[name] = {"local": [g["fused"] for g in opt.reducer._local.param_groups],
                     "saved": [g["fused"] for g in opt.state_dict()["param_groups"]]}
    return out


def test_host_memory_shards_step_in_torchs_fused_kernel_unless_the_user_chose():
    """On CPU torch's default steps one tensor at a time: a rank's shard steps in the fused
    kernel (the same update), unless the optimizer names an implementation; the
    consolidated state keeps the user's own settings."""
    for out in run_workers(_implementations, 2, work_s=20):
        assert out["unset"] == {"local": [True], "saved": [None]}
        assert out["foreach"] == {"local": [None], "saved": [None]}
        assert out["not fused"] == {"local": [False], "saved": [False]}


def _alternating_heads() -> dict:
    """A trunk and two heads, each head used every other step: half the steps a head has
    no gradient (zeros, as Horovod sends, so momentum still moves it); `zero_grad()` drops
    the gradients, or zeros them in place with `set_to_none=False`, as torch's does."""
    import raytrain_x.torch as rx

    rx.init()
    out = {}
    for stage in (0, 1, 2):
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"trunk": torch.nn.Linear(8, 16), "heads": torch.nn.ModuleList(
            [torch.nn.Linear(16, 3) for _ in range(2)])})
        opt = rx.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            named_parameters=model.named_parameters(), zero_stage=stage, bucket_cap_mb=0.0005)
        x = torch.linspace(-1, 1, 32).reshape(4, 8) * (rx.rank() + 1)
        for step in range(6):
            opt.zero_grad(set_to_none=step % 3 != 2)  # zeros in place every third step
            grads = [p.grad for p in model.parameters()]
            if stage and step % 3 != 2:
                assert all(g is None for g in grads), f"stage {stage}: a gradient kept"
            elif stage == 1:  # stage 2 keeps no gradient of a parameter to zero
                assert all(g is not None and not g.any() for g in grads), f"stage {stage}"
            logits = model["heads"][step % 2](torch.tanh(model["trunk"](x)))
            torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 2, 0])).backward()
            opt.step()
        out[stage] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def test_a_parameter_without_a_gradient_reduces_as_zeros_in_every_stage():
    for out in run_workers(_alternating_heads, 2, work_s=20):
        for stage in (1, 2):
            for name, value in out[0].items():
                torch.testing.assert_close(out[stage][name], value, rtol=1e-5, atol=1e-6,
                                           msg=f"stage {stage}: {name}")
