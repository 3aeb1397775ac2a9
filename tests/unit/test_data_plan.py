"""How the elastic trainer divides an epoch of a Ray Data stream into steps
(`raytrain_x.ray.data_plan`) and which checkpoints a run keeps (`train_reports.kept_names`):
pure functions, checked over random worlds, resizes and rollbacks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from raytrain_x.ray.data_plan import block_slices, step_ranges
from raytrain_x.ray.train_reports import kept_names, storage_uri


def test_a_step_divides_its_rows_evenly_and_the_remainder_joins_the_last_step():
    assert step_ranges(0, 3, 4, 100, ended=False) == [(0, 4), (4, 8), (8, 12)]
    assert step_ranges(0, 3, 4, 14, ended=False) is None  # the end may be near: wait
    # 10 rows left for 12: one step of 10; 16 left: a full step, then 4 (not 12 then 1+3)
    assert step_ranges(90, 3, 4, 100, ended=True) == [(90, 93), (93, 96), (96, 100)]
    assert step_ranges(84, 3, 4, 100, ended=True) == [(84, 88), (88, 92), (92, 96)]
    assert step_ranges(96, 3, 4, 100, ended=True) == [(96, 97), (97, 98), (98, 100)]
    assert step_ranges(100, 3, 4, 100, ended=True) == []
    assert step_ranges(0, 4, 4, 2, ended=True) == [(0, 0), (0, 1), (1, 1), (1, 2)]


def test_block_slices_cover_a_range_across_blocks():
    assert block_slices([0, 5, 12], [5, 7, 3], 3, 13) == [(0, 3, 5), (1, 0, 7), (2, 0, 1)]
    assert block_slices([10, 15], [5, 5], 12, 12) == []


@settings(max_examples=300, deadline=None)
@given(total=st.integers(0, 300), per_rank=st.integers(1, 9),
       events=st.lists(st.tuples(st.integers(1, 6), st.booleans(), st.integers(0, 4)),
                       min_size=1, max_size=40))
def test_every_row_is_trained_once_per_epoch_through_resizes_and_rollbacks(total, per_rank,
                                                                          events):
    """The committed history of an epoch: steps at worlds that change, some steps rolled
    back before their commit (a failure). Whatever happened, the committed steps hand out
    each row once, and every rank of a step gets rows while any has (none at most
    `per_rank + 1`)."""
    cursor, committed = 0, []
    for world, fails, steps in events:
        taken = []
        for _ in range(steps):
            ranges = step_ranges(cursor, world, per_rank, total, ended=True)
            if not ranges:
                break
            sizes = [end - start for start, end in ranges]
            assert max(sizes) <= per_rank + 1
            assert min(sizes) > 0 or total - cursor < world
            taken += [row for start, end in ranges for row in range(start, end)]
            cursor = ranges[-1][1]
        if fails:  # rolled back to the last commit: nothing of these steps counts
            cursor -= len(taken)
        else:
            committed += taken
    while ranges := step_ranges(cursor, 2, per_rank, total, ended=True):
        committed += [row for start, end in ranges for row in range(start, end)]
        cursor = ranges[-1][1]
    assert sorted(committed) == list(range(total))


def test_a_run_keeps_the_best_checkpoints_and_always_the_latest():
    records = [{"checkpoint": f"c{i}", "metrics": {"loss": loss}}
               for i, loss in enumerate([5, 1, 3, 2, 9])]
    records.insert(2, {"checkpoint": None, "metrics": {"loss": 0}})  # a report without one
    assert kept_names(records, None, None, "max") == ["c0", "c1", "c2", "c3", "c4"]
    assert kept_names(records, 2, None, "max") == ["c3", "c4"]
    assert kept_names(records, 2, "loss", "min") == ["c1", "c3", "c4"]  # c4: the latest
    assert kept_names(records, 1, "loss", "max") == ["c4"]


def test_a_storage_uri_keeps_its_query_at_the_end():
    assert storage_uri("/data/runs", "job/ckpt") == "/data/runs/job/ckpt"
    assert storage_uri("s3://b/runs/?endpoint_override=127.0.0.1:9000", "job/c") == \
        "s3://b/runs/job/c?endpoint_override=127.0.0.1:9000"


def test_a_shard_refuses_a_local_shuffle_buffer_and_a_bad_batch_size_at_once():
    import pytest

    from raytrain_x.common.errors import ConfigError
    from raytrain_x.ray.data_shard import ElasticDataShard

    shard = ElasticDataShard(feed=None, name="train")
    with pytest.raises(ConfigError, match="local_shuffle_buffer_size is not supported.*"
                                          "random_shuffle"):
        shard.iter_batches(local_shuffle_buffer_size=100)
    with pytest.raises(ConfigError, match="batch_size must be a positive int"):
        shard.iter_torch_batches(batch_size=0)
    shard.load_state_dict({"epoch": 3, "cursor": 120})
    assert (shard.epoch, shard.cursor) == (3, 120)


def test_a_shard_as_a_plain_attribute_is_committed_as_its_position_and_loaded_in_place():
    """The TensorFlow face's states (and `ObjectState`) keep plain attributes: a shard
    among them is committed as its position and loaded back into the same object."""
    from raytrain_x.elastic.state import Attributes
    from raytrain_x.ray.data_shard import ElasticDataShard

    class Owner:
        pass

    owner = Owner()
    owner.data, owner.epoch = ElasticDataShard(feed=None, name="train"), 0
    owner.data.load_state_dict({"epoch": 1, "cursor": 64})
    attributes = Attributes(owner, ["data", "epoch"], bcast_object=None)
    committed = attributes.take()
    shard = owner.data
    shard.load_state_dict({"epoch": 1, "cursor": 96})  # steps after the commit
    attributes.load(committed.copy())
    assert owner.data is shard and (shard.epoch, shard.cursor) == (1, 64)


def test_the_private_ray_hooks_the_elastic_trainer_relies_on_are_as_checked():
    """`internals.py` names the private hooks of public Ray classes the elastic trainer
    overrides or calls; a Ray release that changes them fails here, not in a job."""
    import inspect

    from ray.data import DataIterator
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from raytrain_x.ray.internals import DATA_ITERATOR_HOOK

    parameters = inspect.signature(DataIterator._iter_batches).parameters
    assert set(DATA_ITERATOR_HOOK) <= set(parameters), sorted(parameters)
    assert callable(DataParallelTrainer._get_train_func)


def test_a_tune_trial_takes_the_report_queue_as_the_hand_over_expects():
    """`internals.wait_tune_took_reports` relies on the Tune trial's session taking one item
    of `TuneReportCallback`'s queue (size 1) per result and skipping a falsy one: an empty
    dict taken from the queue is not a result, a report is."""
    import queue
    import threading

    from ray.train._internal.session import _TrainSession

    class Items:  # the inter-actor queue's get(), as the session calls it
        def __init__(self, items):
            self.items = list(items)

        def get(self, block=True, timeout=None):
            if not self.items:
                from ray.util.queue import Empty
                raise Empty
            return self.items.pop(0)

    session = _TrainSession.__new__(_TrainSession)
    session.result_queue, session.continue_lock = queue.Queue(), threading.Semaphore(0)
    reported = []
    session.report = lambda metrics: (session.continue_lock.acquire(),
                                      reported.append(metrics),
                                      session.result_queue.put(metrics))
    session._inter_actor_queue = Items([{}])
    assert session._get_result_from_queues(block=False) is None and reported == []
    session._inter_actor_queue = Items([{"score": 1}])
    assert session._get_result_from_queues(block=False) == {"score": 1}
