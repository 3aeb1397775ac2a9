"""A GPT sharded with torch's FSDP2 (`fully_shard` per block, then the model), trained
elastically: when a worker dies, drains or joins, the model's and AdamW's chunks are
re-sharded over the new world in memory, and training goes on from the last commit.

Run it with the launcher (any number of workers between --min-np and --max-np):

    raytrain-x run -np 2 --min-np 1 --max-np 2 python examples/elastic_fsdp.py

`--exit-once PATH` makes the last rank of the first world exit at step 5 (once: it
leaves PATH behind), to see the survivors re-shard and train on.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.distributed.fsdp import fully_shard

import raytrain_x.torch as rx
from raytrain_x.torch.workloads import GPTDecoder, markov_tokens

GLOBAL_BATCH, SEQ, VOCAB = 12, 16, 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--exit-once", default=None)
    args = parser.parse_args()

    rx.init()
    model = GPTDecoder(vocab=VOCAB, layers=2, width=32, heads=2, seq=SEQ)
    mesh = rx.device_mesh()  # the round's mesh: a new round gives FSDP2 a new one
    for block in model.blocks.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    # each rank's chunks are committed with a copy on one peer (replicas=1)
    state = rx.elastic.TorchState(model, optimizer, replicas=1, step=0, sizes=[])

    @rx.elastic.run
    def train(state: rx.elastic.TorchState) -> float:
        loss = torch.zeros(())
        while state.step < args.steps:
            if (args.exit_once and state.step == 5 and rx.rank() == rx.size() - 1
                    and rx.size() > 1 and not os.path.exists(args.exit_once)):
                open(args.exit_once, "w").close()
                os._exit(1)  # a worker lost mid-training
            # the global batch stays the same whatever the world: each rank its part
            inputs, targets = markov_tokens(GLOBAL_BATCH, SEQ, VOCAB, seed=1000 + state.step)
            part = slice(rx.rank() * GLOBAL_BATCH // rx.size(),
                         (rx.rank() + 1) * GLOBAL_BATCH // rx.size())
            logits = model(inputs[part])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                     targets[part].reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            state.sizes.append(rx.size())
            state.step += 1
            state.commit()
        return rx.allreduce(loss.detach(), op=rx.Average, name="final_loss").item()

    final = train(state)
    if rx.rank() == 0:
        changes = [s for i, s in enumerate(state.sizes) if i == 0 or state.sizes[i - 1] != s]
        print(f"loss {final:.4f} after {state.step} steps; workers {changes}; "
              f"restored {rx.elastic.restore_count()} time(s)")


if __name__ == "__main__":
    main()
