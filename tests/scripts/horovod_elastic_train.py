"""An elastic training script as Horovod's elastic integration tests write theirs, with only
its import changed: a `TorchState` with the user's own `commits` and `rendezvous` counters
beside the model and optimizer, a reset callback rescaling the learning rate, rank 0 logging
one JSON line per epoch, `state._host_messages` read as Horovod's scripts read it, and a
schedule of (epoch, batch) at which a starting rank raises or kills its own process."""

import argparse
import json
import os
import signal

import torch
import torch.nn.functional as F

import raytrain_x.torch as hvd  # was: import horovod.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batches-per-epoch", type=int, default=4)
parser.add_argument("--logfile", required=True)
parser.add_argument("--exit-schedule", default="{}")
parser.add_argument("--exit-mode", default="exception", choices=["exception", "kill"])
args = parser.parse_args()

hvd.init()
lr = 0.001
model = torch.nn.Sequential(torch.nn.Linear(2, 2))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr * hvd.size()),
                                     named_parameters=model.named_parameters())
start_rank = int(os.environ.get("HOROVOD_RANK", 0))
exits = json.loads(args.exit_schedule)
data, target = torch.randn(16, 2), torch.randint(0, 2, (16,))


def maybe_exit(epoch: int, batch: int) -> None:
    if start_rank in exits.get(str((epoch, batch)), []):
        if args.exit_mode == "exception":
            raise RuntimeError(f"scheduled exit at epoch={epoch} batch={batch} "
                               f"start_rank={start_rank}")
        os.kill(os.getpid(), signal.SIGKILL)


@hvd.elastic.run
def train(state):
    state.rendezvous += 1
    while state.epoch < args.epochs:
        while state.batch < args.batches_per_epoch:
            maybe_exit(state.epoch, state.batch)
            optimizer.zero_grad()
            F.cross_entropy(model(data), target).backward()
            optimizer.step()
            state.batch += 1
            state.commits += 1
            state.commit()
        if hvd.rank() == 0:
            with open(args.logfile, "a") as f:
                f.write(json.dumps({"epoch": state.epoch, "commits": state.commits,
                                    "start_rank": start_rank, "rank": hvd.rank(),
                                    "size": hvd.size(), "rendezvous": state.rendezvous,
                                    "host_messages": state._host_messages.empty()}) + "\n")
        state.epoch += 1
        state.batch = 0
        state.commits += 1
        state.commit()


def on_state_reset():
    for group in optimizer.param_groups:
        group["lr"] = lr * hvd.size()


state = hvd.elastic.TorchState(model, optimizer, batch=0, epoch=0, commits=0, rendezvous=0)
state.register_reset_callbacks([on_state_reset])
train(state)
