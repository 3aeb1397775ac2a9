"""A torch job that keeps a ledger of every step it commits (`raytrain_x.testing.jobs.ledger`
checks it): the elastic tests and the chaos soak train with it."""

from __future__ import annotations

import os
import time

from raytrain_x.testing.jobs.ledger import SAMPLES, write_progress


def ledger_train(steps: int | None = None, pause: float = 0.05, *, stop: str | None = None,
                 progress: str | None = None, samples: int = SAMPLES,
                 zero_stage: int = 0) -> dict:
    """Trains a small torch model elastically, one commit per step, until `steps` steps are
    committed or the `stop` file exists (every rank agrees at the same step).

    Each step takes one sample per rank from an `ElasticSampler` (which re-shards what is
    left of the epoch at a reset), records every rank's sample (`seen`), and appends the
    step to the committed ledger (`done_steps`). Rank 0 writes "step size" to `progress`.
    With `zero_stage` 1 or 2 the optimizer is a sharded Adam, whose per-parameter step
    counts (`optimizer_steps`, from the consolidated state) must equal the committed steps:
    a shard lost or restored from the wrong commit shows there.
    """
    import torch

    import raytrain_x.torch as rx
    from raytrain_x.common.process import PROCESS
    from raytrain_x.core import runtime

    rx.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    inner = (torch.optim.Adam(model.parameters(), lr=0.01) if zero_stage else
             torch.optim.SGD(model.parameters(), lr=0.01))
    opt = rx.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                  zero_stage=zero_stage)
    sampler = rx.elastic.ElasticSampler(range(samples), seed=1)
    state = rx.elastic.TorchState(model, opt, sampler=sampler, step=0, done_steps=[],
                                  sizes=[], epoch=0, seen={0: []})

    def stopping() -> bool:
        if stop is None:
            return False
        flag = torch.tensor([float(os.path.exists(stop))])
        return bool(rx.allreduce(flag, op=rx.Max, name="ledger.stop").item())

    @rx.elastic.run
    def train(state):
        # in the worker's log (the chaos soak keeps those of a failed run): where each
        # round starts it from
        print(f"ledger: rank {rx.rank()} of {rx.size()} starts at step {state.step} "
              f"(round {runtime.rendezvous().round})", flush=True)
        batches = enumerate(state.sampler)
        while (steps is None or state.step < steps) and not stopping():
            batch = next(batches, None)
            if batch is None:  # the epoch is done: the next one
                state.epoch += 1
                state.sampler.set_epoch(state.epoch)
                state.seen[state.epoch] = []
                batches = enumerate(state.sampler)
                batch = next(batches)
            batch_idx, index = batch
            position = batch_idx * state.sampler.num_replicas + state.sampler.rank
            padding = position >= len(state.sampler.remaining_indices)  # equal shards
            opt.zero_grad()
            # the gradient depends on the sample, so the weights depend on every sample's
            # step: a step lost or doubled on one rank shows in its weights
            model(torch.full((8, 4), float(index) / samples)).sum().backward()
            opt.step()
            everyone = rx.allgather_object([] if padding else [index])
            state.seen[state.epoch].extend(i for part in everyone for i in part)
            state.sampler.record_batch(batch_idx, 1)
            state.done_steps.append(state.step)
            state.sizes.append(rx.size())
            state.step += 1
            time.sleep(pause)
            state.commit()
            if progress and rx.rank() == 0:
                write_progress(progress, state.step, rx.size())
        result = {"step": state.step, "done_steps": list(state.done_steps),
                  "sizes": list(state.sizes), "rank": rx.rank(), "seen": dict(state.seen),
                  "weight": [x for p in model.parameters()
                             for x in p.detach().flatten().tolist()],
                  "restores": rx.elastic.restore_count(),
                  "restores_from_storage": PROCESS.checkpoints.restored_count,
                  # horovodrun's variables, as the last reset left them
                  "horovod_env": [os.environ.get(f"HOROVOD_{k}") for k in ("RANK", "SIZE")]}
        if zero_stage:  # every rank calls the consolidated state_dict
            result["optimizer_steps"] = sorted(
                {int(s["step"]) for s in opt.state_dict()["state"].values()})
        return result

    return train(state)
