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


def test_horovods_ray_elastic_example_with_its_discovery_logger_and_callbacks(elastic_nodes):
    """Horovod's Ray elastic example and tests: `from horovod.ray import ray_logger`,
    `from horovod.torch.elastic.sampler import ElasticSampler`, `settings.discovery` with
    `override_discovery=False`, callbacks that get what the workers log as they log it.
    The discovery lists host a until a's worker trains, then a and b until both train in
    one world, then b alone: both workers start and say so, only b's finishes; `max_np=None`
    takes every host listed. The discovery follows what the callbacks saw (Horovod's
    SimpleTestDiscovery counts its looks, which ties the test to the machine's speed), and
    the loop ends once it has trained in a world of 2 and then alone."""
    import warnings

    from raytrain_x.ray import ElasticRayExecutor, HostDiscovery

    a, b = elastic_nodes(2)
    events: list[dict] = []

    class FollowingDiscovery(HostDiscovery):
        """Hosts by what the workers logged so far."""

        def find_available_hosts_and_slots(self):
            sizes = [e["size"] for e in list(events) if "training" in e]
            if not sizes:
                hosts = [a.node_id]
            elif 2 not in sizes:
                hosts = [a.node_id, b.node_id]
            else:
                hosts = [b.node_id]
            return dict.fromkeys(hosts, 1)

    def training_fn():
        import os
        from time import sleep

        import torch
        from raytrain_x.torch.elastic.sampler import ElasticSampler

        import raytrain_x.torch as hvd
        from raytrain_x.ray import ray_logger

        hvd.init()
        model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ray_logger.log({"started": True, "pid": os.getpid()})

        @hvd.elastic.run
        def train(state):
            # Horovod's example runs 200 epochs; this one runs until it has trained with 2
            # and then 3 epochs alone again (the bound only stops a broken run)
            for state.epoch in range(state.epoch, 5000):  # noqa: B020 - Horovod's example
                ray_logger.log({"training": True, "pid": os.getpid(), "size": hvd.size()})
                state.grown = state.grown or hvd.size() == 2
                state.alone_after = state.alone_after + 1 if state.grown and \
                    hvd.size() == 1 else 0
                if state.alone_after > 3:
                    break
                state.sampler.record_batch(0, 1)
                sleep(0.05)
                state.commit()
            ray_logger.log({"finished": True, "pid": os.getpid()})

        state = hvd.elastic.TorchState(model, optimizer, sampler=ElasticSampler(range(8)),
                                       batch=0, epoch=0, grown=False, alone_after=0)
        train(state)
        return True

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        settings = ElasticRayExecutor.create_settings(min_np=1, timeout_s=10)
        settings.discovery = FollowingDiscovery()
        executor = ElasticRayExecutor(settings, cpus_per_slot=1, override_discovery=False)
    executor.start()
    try:
        results = executor.run(training_fn, callbacks=[events.append])
    finally:
        executor.shutdown()
    assert results == [True]
    assert sum("started" in e for e in events) == 2, events
    assert sum("finished" in e for e in events) == 1, events
    assert {e["size"] for e in events if "training" in e} == {1, 2}


def test_a_fixed_jobs_callbacks_get_rank_0s_logged_values(ray_cluster):
    """Horovod's `RayExecutor.run(fn, callbacks=...)`: every value rank 0 logs, as it logs
    it (the callbacks ran once per rank with `(rank, result)` at the end)."""
    from raytrain_x.ray import RayExecutor

    def fn():
        import raytrain_x.torch as hvd
        from raytrain_x.ray import ray_logger

        hvd.init()
        for step in range(3):
            ray_logger.log({"rank": hvd.rank(), "step": step})
        return hvd.rank()

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
    executor.start()
    seen: list[dict] = []
    try:
        assert executor.run(fn, callbacks=[seen.append]) == [0, 1]
    finally:
        executor.shutdown()
    assert seen == [{"rank": 0, "step": s} for s in range(3)]
