"""A small GPT sharded by torch's FSDP2 (`fully_shard` per block, then the model; AdamW),
trained elastically on a fixed global batch: the tests of in-memory re-sharding run it
under kills, drains and adds, and compare its losses with `reference_losses`, the same
model trained whole in one process."""

from __future__ import annotations

import os
import time
from typing import Any

from raytrain_x.testing.jobs.ledger import write_progress

GLOBAL_BATCH = 12  # sequences a step, cut evenly over 1, 2, 3, 4 or 6 ranks
SEQ, VOCAB = 16, 64
LR = 0.01


def model() -> Any:
    from raytrain_x.torch.workloads import GPTDecoder

    return GPTDecoder(vocab=VOCAB, layers=2, width=32, heads=2, seq=SEQ)


def batch(step: int) -> tuple[Any, Any]:
    """The global batch of `step`: (inputs, next tokens), the same on every rank."""
    from raytrain_x.torch.workloads import markov_tokens

    return markov_tokens(GLOBAL_BATCH, SEQ, VOCAB, seed=1000 + step)


def _loss(net: Any, inputs: Any, targets: Any) -> Any:
    import torch

    logits = net(inputs)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def reference_losses(steps: int) -> list[float]:
    """The loss of every step, the model trained whole on the global batch."""
    import torch

    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        inputs, targets = batch(step)
        loss = _loss(net, inputs, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def fsdp_train(steps: int | None = None, pause: float = 0.0, *, stop: str | None = None,
               progress: str | None = None, replicas: int = 1,
               background: bool = False) -> dict:
    """Trains the GPT sharded over the round's mesh, one commit a step, until `steps` steps
    or the `stop` file (every rank stops at the same step); with `background`, each
    commit's copies travel while training goes on. Each rank takes its even part
    of the global batch; the reported loss is the global batch's (the ranks' mean). Rank 0
    writes "step size" to `progress` and appends each committed step to `progress.steps`.

    Returns:
        This rank's committed record: `step`, `losses` (one a step), `sizes` (the world of
        each step), `restores` (rollbacks to a commit) and `restored_from` (the number of
        the durable checkpoint it restored, None where it restored none).
    """
    import torch
    from torch.distributed.fsdp import fully_shard

    import raytrain_x.torch as rx

    rx.init()
    net = model()
    mesh = rx.device_mesh()
    for block in net.blocks.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    state = rx.elastic.TorchState(net, opt, replicas=replicas,
                                  commit_in_background=background, step=0, losses=[],
                                  sizes=[])

    @rx.elastic.run
    def train(state: Any) -> dict:
        while True:
            done = state.step >= steps if steps is not None else rx.broadcast_object(
                os.path.exists(stop), 0, name="fsdp_gpt.stop")
            if done:
                break
            rank, size = rx.rank(), rx.size()
            inputs, targets = batch(state.step)
            part = slice(rank * GLOBAL_BATCH // size, (rank + 1) * GLOBAL_BATCH // size)
            loss = _loss(net, inputs[part], targets[part])
            opt.zero_grad()
            loss.backward()
            opt.step()
            mean = rx.allreduce(loss.detach(), op=rx.Average, name="fsdp_gpt.loss")
            state.losses.append(mean.item())
            state.sizes.append(size)
            state.step += 1
            state.commit()
            if rank == 0 and progress:
                write_progress(progress, state.step, size)
                with open(f"{progress}.steps", "a") as log:  # every commit rank 0 made
                    log.write(f"{state.step}\n")
            time.sleep(pause)
        return {"step": state.step, "losses": list(state.losses),
                "sizes": list(state.sizes), "restores": rx.elastic.restore_count(),
                "restored_from": None if state.restored_from is None
                else state.restored_from.number, "rank": rx.rank()}

    return train(state)
