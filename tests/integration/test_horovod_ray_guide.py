"""The Ray blocks of Horovod's guide ("Horovod Ray Executor", "Stateful Execution",
"Elastic Ray Executor"), as Horovod's docs write them with the imports changed to
raytrain-x's. The guide's placeholders are filled with the digits workload (scikit-learn's
digits, a small MLP); `use_gpu=True` becomes False on this CPU cluster, and the elastic
block's workers take the test nodes' resource."""

from __future__ import annotations

import torch

from tests.conftest import ELASTIC_RESOURCE


def _digits(rank: int, size: int):
    """This rank's shard of the digits (features scaled to [0, 1]) and the labels."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x[rank::size] / 16.0, dtype=torch.float32)
    return x, torch.tensor(y[rank::size])


class NeuralNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                          torch.nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def test_the_horovod_ray_executor_block(ray_cluster):
    import raytrain_x.torch as hvd
    from raytrain_x.ray import RayExecutor

    setting = RayExecutor.create_settings(timeout_s=30)
    num_workers, hosts, num_slots = 2, 1, 2
    # --- the guide's block, from here
    executor = RayExecutor(
        setting, num_workers=num_workers, use_gpu=False)
    executor.start()

    def simple_fn():
        hvd.init()
        print("hvd rank", hvd.rank())
        return hvd.rank()

    result = executor.run(simple_fn)
    assert len(set(result)) == hosts * num_slots

    executor.shutdown()


class MyModel:
    """The guide's stateful class; `_train` is one epoch over this rank's digits."""

    def __init__(self, learning_rate):
        import raytrain_x.torch as hvd

        hvd.init()
        torch.manual_seed(0)
        self.model = NeuralNet()
        optimizer = torch.optim.SGD(
            self.model.parameters(),
            lr=learning_rate,
        )
        self.optimizer = hvd.DistributedOptimizer(
            optimizer, named_parameters=self.model.named_parameters())
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)

    def get_weights(self):
        return dict(self.model.named_parameters())

    def train(self):
        return self._train(self.model, self.optimizer)

    def _train(self, model, optimizer):
        import raytrain_x.torch as hvd

        x, y = _digits(hvd.rank(), hvd.size())
        total = 0.0
        for i in range(0, len(x), 32):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
            loss.backward()
            optimizer.step()
            total += loss.item()
        return total


def test_the_stateful_execution_block(ray_cluster):
    from raytrain_x.ray import RayExecutor

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
    # --- the guide's block, from here
    executor.start(executable_cls=MyModel, executable_args=(0.1,))
    losses = []
    for _ in range(5):
        losses.append(executor.execute(lambda worker: worker.train()))
    result = executor.execute(lambda worker: worker.get_weights())
    assert all(isinstance(res, dict) for res in result)
    executor.shutdown()
    assert sum(losses[-1]) < sum(losses[0])  # it learns
    for name, value in result[0].items():  # the replicas agree
        assert torch.allclose(value, result[1][name])


def training_fn():
    """The guide's elastic training function, its `...` filled with the digits."""
    import raytrain_x.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = NeuralNet()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    epochs = 3

    @hvd.elastic.run
    def train(state):
        x, y = _digits(hvd.rank(), hvd.size())
        for state.epoch in range(state.epoch, epochs):  # noqa: B020 - as the guide writes it
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            state.commit()

    def on_state_reset():
        pass

    state = hvd.elastic.TorchState(model, optimizer, batch=0, epoch=0)
    state.register_reset_callbacks([on_state_reset])
    train(state)
    return state.epoch


def test_the_elastic_ray_executor_block(elastic_nodes):
    from raytrain_x.ray import RayExecutor

    elastic_nodes(2)
    # --- the guide's block, from here (use_gpu=True on a GPU cluster)
    settings = RayExecutor.create_settings(verbose=True)
    executor = RayExecutor(
        settings, min_workers=1, use_gpu=False, cpus_per_slot=1,
        resources_per_worker={ELASTIC_RESOURCE: 1})
    executor.start()
    try:
        epochs = executor.run(training_fn)
    finally:
        executor.shutdown()
    assert epochs and all(e == 2 for e in epochs), epochs
