"""A training script written against Horovod's PyTorch API, with only its import changed:
positional arguments in Horovod's order, Horovod's names, HOROVOD_* settings from the
environment, hvd.HorovodInternalError in an except clause."""

import sys

import torch
import torch.nn.functional as F

import raytrain_x.torch as hvd  # was: import horovod.torch as hvd

hvd.init()
torch.manual_seed(hvd.rank())

model = torch.nn.Sequential(torch.nn.Linear(4, 8), hvd.SyncBatchNorm(8), torch.nn.ReLU(),
                            torch.nn.Linear(8, 1))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
# Horovod's positional order: named_parameters, compression, backward_passes_per_step, op
optimizer = hvd.DistributedOptimizer(optimizer, model.named_parameters(),
                                     hvd.Compression.fp16, 1, hvd.Average)
hvd.broadcast_optimizer_state(optimizer, 0)

x = torch.randn(64, 4)
y = x.sum(dim=1, keepdim=True)
losses = []
for _epoch in range(30):
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    # allreduce(tensor, average, name): Horovod's positional order
    losses.append(hvd.allreduce(loss.detach(), True, "avg_loss").item())

gathered = hvd.allgather(torch.tensor([hvd.rank()]), "ranks")
handle = hvd.allreduce_async(torch.ones(3), None, "async_sum", hvd.Sum)
summed = hvd.synchronize(handle)
try:
    hvd.allreduce(torch.ones(2 + hvd.rank()), name="disagree")  # ranks disagree on the shape
    caught = "nothing"
except hvd.HorovodInternalError:
    caught = "HorovodInternalError"
except RuntimeError as exc:  # what Horovod raises for a mismatch
    caught = type(exc).__name__
if hvd.rank() == 0:
    print(f"first loss {losses[0]:.3f} last loss {losses[-1]:.3f} ranks {gathered.tolist()} "
          f"sum {summed.tolist()} caught {caught}")
hvd.shutdown()
sys.exit(0 if losses[-1] < losses[0] else 1)
