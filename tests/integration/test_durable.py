"""Durable checkpoints of an elastic `TorchState`, between real processes: written in the
background to a local path and to an S3-compatible server (moto's, on loopback), complete
only with their manifest, read back at another world size, the damaged ones skipped, and
training going on while storage is down."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from raytrain_x.common.checkpoint_config import CheckpointConfig
from raytrain_x.elastic.checkpoints import CheckpointStore
from raytrain_x.elastic.durable import part_kind
from raytrain_x.testing.waiting import free_port
from tests.workers import run_workers


def _train(storage: str, steps: int, stage: int, every_s: float = 1e9,
           checkpoint_at: tuple[int, ...] = (), signals: str = "") -> dict:
    """Trains a small model to `steps` with a commit each step (from a durable checkpoint,
    where one exists), calls `state.checkpoint()` after the steps in `checkpoint_at`, and
    returns what it ended with."""
    import raytrain_x.torch as rx
    from raytrain_x.common.process import PROCESS

    rx.init()
    torch.manual_seed(100 + rx.rank())  # the ranks start apart: the sync or restore shows
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = rx.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.05),
                                  named_parameters=model.named_parameters(), zero_stage=stage)
    config = CheckpointConfig(storage, name="job", every_s=every_s)
    state = rx.elastic.TorchState(model, opt, checkpoint=config, step=0, seen=[])
    started_at: list[int] = []

    @rx.elastic.run
    def train(state):
        started_at.append(state.step)
        while state.step < steps:
            g = torch.Generator().manual_seed(1000 * state.step + rx.rank())
            x = torch.randn(8, 6, generator=g)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            state.step += 1
            state.seen = [*state.seen, state.step]
            state.commit()
            if state.step in checkpoint_at:
                state.checkpoint()
            if signals and rx.rank() == 0 and state.step in (3, 6):
                _storage_outage(signals, state.step == 3)

    train(state)
    restored = getattr(state, "restored_from", None)
    full = opt.state_dict()  # consolidated on every rank (a collective with sharding)
    out = {"started_at": started_at[0], "restored": None if restored is None else
           restored.number, "restored_values": None if restored is None else restored.values,
           "step": state.step, "seen": state.seen,
           "model": {k: v.clone() for k, v in model.state_dict().items()},
           "opt": full, "counters": dict(vars(PROCESS.checkpoints))}
    rx.shutdown()
    return out


def _resume_with(storage: str, attributes: dict) -> dict:
    """`_train`'s job resumed with other plain attributes; what the state holds after."""
    import raytrain_x.torch as rx

    rx.init()
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = rx.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.05),
                                  named_parameters=model.named_parameters())
    state = rx.elastic.TorchState(model, opt, checkpoint=CheckpointConfig(storage, name="job"),
                                  **attributes)

    @rx.elastic.run
    def train(state):
        return {name: getattr(state, name, "absent") for name in ("step", "seen", "best_loss")}

    out = train(state)
    rx.shutdown()
    return out


def _storage_outage(signals: str, stop: bool) -> None:
    """Rank 0 of `_train`: storage goes away (at step 3, once a checkpoint was written
    before it); at step 6 it waits until a write has failed (one started after the stop,
    due at every commit, meets the outage once its retries are spent), and storage comes
    back."""
    import raytrain_x.torch as rx  # noqa: F401 - the caller's world
    from raytrain_x.common.process import PROCESS

    if stop:
        deadline = time.monotonic() + 60
        while PROCESS.checkpoints.written_count < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        _ask(signals, "stop")
        return
    deadline = time.monotonic() + 120  # the write's retries give up within about 20 s
    while PROCESS.checkpoints.failed_count < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    _ask(signals, "start")


def _ask(signals: str, what: str) -> None:
    """Asks the test for `what` and waits until it is done (an order of events, not a
    sleep)."""
    Path(signals, what).touch()
    deadline = time.monotonic() + 60
    while not Path(signals, f"{what}.done").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.fixture
def s3_server():
    """moto's S3 server on loopback, started and stopped by the test; yields a function
    that gives a storage URI under a fresh bucket, and the server (to stop and start)."""
    pytest.importorskip("moto")
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    keys = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)

    def uri(bucket: str) -> str:
        return (f"s3://{bucket}/runs?endpoint_override=127.0.0.1:{port}&scheme=http"
                "&allow_bucket_creation=true")

    holder = {"server": server}
    try:
        yield uri, holder, port
    finally:
        holder["server"].stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_s3_keeps_the_storage_contract(s3_server, tmp_path):
    """S3 through pyarrow, against moto's S3-compatible server, under the retries, as a
    job's checkpoints use it (`raytrain_x.testing.storage_contract`)."""
    from raytrain_x.elastic.checkpoints import open_storage
    from raytrain_x.testing.storage_contract import CLAUSES, check_storage

    uri, _, _ = s3_server
    assert check_storage(open_storage(uri("contract")), str(tmp_path)) == \
        [text for text, _ in CLAUSES]


def _same(a: dict, b: dict) -> None:
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["opt"]["state"].keys() == b["opt"]["state"].keys()
    for i, s in a["opt"]["state"].items():
        for name, value in s.items():
            other = b["opt"]["state"][i][name]
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), (i, name)


def test_a_checkpoint_written_by_2_ranks_resumes_a_new_job_of_3(tmp_path):
    storage = str(tmp_path / "store")
    first = run_workers(_train, 2, storage, 4, 0, 1e9, (4,), work_s=40)
    store = CheckpointStore(CheckpointConfig(storage, name="job"))
    [manifest] = store.checkpoints()
    assert manifest.values["step"] == 4 and manifest.world_size == 2
    [common] = manifest.parts
    assert part_kind(common) == "common"
    # plain torch reads it
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(store.where(manifest.key, common), tmp_path / "plain.pt")
    plain = torch.load(tmp_path / "plain.pt", weights_only=False)
    weight = plain["state"]["handled"]["model"]["0.weight"]
    assert torch.equal(weight, first[0]["model"]["0.weight"])

    second = run_workers(_train, 3, storage, 6, 0, work_s=40)
    for out in second:
        assert out["started_at"] == 4 and out["restored"] == manifest.number
        assert out["seen"] == [1, 2, 3, 4, 5, 6]  # every step before the checkpoint once
        assert out["counters"]["restored_count"] == 1
    assert all(torch.equal(second[0]["model"][k], o["model"][k])
               for o in second[1:] for k in o["model"])


@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_state_written_at_3_ranks_is_restored_at_2_equal_to_the_consolidated(
        tmp_path, stage):
    storage = str(tmp_path / "store")
    first = run_workers(_train, 3, storage, 3, stage, 1e9, (3,), work_s=40)
    [manifest] = CheckpointStore(CheckpointConfig(storage, name="job")).checkpoints()
    assert sorted(map(part_kind, manifest.parts)) == [
        "common", "shard_00000", "shard_00001", "shard_00002"]
    second = run_workers(_train, 2, storage, 3, stage, work_s=40)
    for out in second:
        assert out["restored"] == manifest.number and out["step"] == 3
        _same(first[0], out)


def test_a_damaged_checkpoint_is_skipped_for_the_one_before(tmp_path, caplog):
    storage = str(tmp_path / "store")
    run_workers(_train, 2, storage, 4, 0, 1e9, (2, 4), work_s=40)
    store = CheckpointStore(CheckpointConfig(storage, name="job", keep=5))
    newest, older = store.checkpoints()
    assert (newest.values["step"], older.values["step"]) == (4, 2)
    # cut off mid-write: a data file shorter than its manifest says
    data = next(Path(store.where(newest.key, next(iter(newest.parts)))).glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:10])
    [left] = store.checkpoints()
    assert left.number == older.number
    # and one with no manifest at all, newer still, as a killed writer leaves it
    Path(store.where((newest.generation, newest.number + 5), "common")).mkdir(parents=True)
    out = run_workers(_train, 2, storage, 4, 0, work_s=40)
    assert [o["started_at"] for o in out] == [2, 2]
    assert out[0]["restored"] == older.number and out[0]["seen"] == [1, 2, 3, 4]


def test_a_shard_damaged_where_only_its_new_owner_reads_it_restores_the_one_before(
        tmp_path):
    """Rank 0 read the whole checkpoint to check it before any rank loaded a byte. Now each
    rank checks only what it reads: a byte flipped in one parameter's optimizer state in
    rank 2's shard part is found by the rank that owns that parameter now, and every rank
    restores the checkpoint before; the damaged one is set aside, not deleted."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = str(tmp_path / "store")
    first = run_workers(_train, 3, storage, 4, 1, 1e9, (2, 4), work_s=60)
    store = CheckpointStore(CheckpointConfig(storage, name="job"))
    newest, older = store.checkpoints()
    shard = store.where(newest.key, next(p for p in newest.parts
                                         if part_kind(p) == "shard_00002"))
    items = FileSystemReader(shard).read_metadata().storage_data
    item = next(v for k, v in items.items() if k.fqn.endswith(".exp_avg_sq"))
    data = Path(shard, item.relative_path)
    raw = bytearray(data.read_bytes())
    raw[item.offset + item.length - 2] ^= 0x40
    data.write_bytes(bytes(raw))
    out = run_workers(_train, 3, storage, 4, 1, work_s=60)
    for o in out:
        assert o["started_at"] == 2 and o["restored"] == older.number
        _same(first[0], o)  # steps 3 and 4 again, from the intact checkpoint
    assert Path(store.where(newest.key), "damaged").exists()
    assert [m.number for m in store.checkpoints()] == [older.number]


def test_every_checkpoint_damaged_stops_the_rerun_with_each_named_and_deletes_none(
        tmp_path):
    """The only checkpoint damaged at its size (a byte flipped in a data file), the same
    command run again: it started from step 0 with one warning, and its first checkpoint
    pruned the damaged one. Now every rank stops with the checkpoint named and why, and
    the folder is left as it was."""
    storage = str(tmp_path / "store")
    run_workers(_train, 2, storage, 2, 0, 1e9, (2,), work_s=40)
    store = CheckpointStore(CheckpointConfig(storage, name="job"))
    [only] = store.checkpoints()
    data = next(Path(store.where(only.key, next(iter(only.parts)))).glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    out = run_workers(_train, 2, storage, 4, 0, 1e9, (4,), work_s=40, allow_failures=True)
    for text in out:
        assert isinstance(text, str) and "CheckpointError" in text, text
        assert "no checkpoint of this job can be restored" in text and only.folder in text
        assert "is damaged" in text and "CheckpointConfig(name=...)" in text
    assert [p.name for p in Path(storage, "job").glob("checkpoint_*")] == [only.folder]


def test_a_new_attribute_keeps_its_value_and_a_removed_one_is_dropped(tmp_path):
    """One plain attribute added to the state (`best_loss`) refused the resume, offering
    only a new name or the folder deleted: the weights were out of reach. An attribute
    the checkpoint lacks now keeps the value given, one only the checkpoint has is
    dropped; the model and the other attributes resume."""
    storage = str(tmp_path / "store")
    run_workers(_train, 2, storage, 2, 0, 1e9, (2,), work_s=40)
    out = run_workers(_resume_with, 2, storage, {"step": 0, "best_loss": 1.5}, work_s=40)
    assert out == [{"step": 2, "seen": "absent", "best_loss": 1.5}] * 2


@pytest.mark.parametrize("written,resumed", [(0, 1), (1, 0), (1, 2)])
def test_another_zero_stage_resumes_or_is_refused_saying_which(tmp_path, written, resumed):
    """A checkpoint's zero_stage changed between runs (0 -> 1, 1 -> 0) passed the check
    and crashed with a raw ValueError; it is refused naming the stage to resume with.
    Stages 1 and 2 keep the same shards: one resumes the other."""
    storage = str(tmp_path / "store")
    run_workers(_train, 2, storage, 2, written, 1e9, (2,), work_s=40)
    out = run_workers(_train, 2, storage, 4, resumed, 1e9, (4,), work_s=40,
                      allow_failures=True)
    if {written, resumed} == {1, 2}:
        assert [o["started_at"] for o in out] == [2, 2] and out[0]["step"] == 4
        return
    for text in out:
        assert isinstance(text, str) and "CheckpointError" in text, text
        assert "resume it with the zero_stage it was written with " \
               f"({'0' if written == 0 else '1 or 2'}" in text, text
        assert "ValueError" not in text and "AttributeError" not in text


def test_checkpoints_on_s3_keep_the_last_two_and_survive_an_outage(s3_server, tmp_path):
    uri, holder, port = s3_server
    signals = tmp_path / "signals"
    signals.mkdir()
    from moto.server import ThreadedMotoServer

    def serve() -> None:  # the test's side of `_storage_outage`
        for what in ("stop", "start"):
            while not (signals / what).exists():
                time.sleep(0.05)
            if what == "stop":
                holder["server"].stop()
            else:
                holder["server"] = ThreadedMotoServer(ip_address="127.0.0.1", port=port,
                                                      verbose=False)
                holder["server"].start()
            (signals / f"{what}.done").touch()

    watcher = threading.Thread(target=serve, daemon=True)
    watcher.start()
    storage = uri("ckpts")
    # every commit is due (every_s tiny): writes overlap the steps and the outage
    out = run_workers(_train, 2, storage, 12, 0, 0.001, (12,), str(signals), work_s=90)
    watcher.join(5)
    counters = out[0]["counters"]
    assert out[0]["step"] == 12 and counters["failed_count"] >= 1
    store = CheckpointStore(CheckpointConfig(storage, name="job"))
    kept = store.checkpoints()
    assert len(kept) == 2 and kept[0].values["step"] == 12  # the last one, after the outage
    assert counters["last_written"] == kept[0].number
    resumed = run_workers(_train, 2, storage, 13, 0, work_s=40)
    assert resumed[0]["started_at"] == 12 and resumed[0]["seen"][-1] == 13


def test_credentials_s3_refuses_fail_at_once_naming_the_path(s3_server, monkeypatch):
    """A 403 (moto checking credentials, which it knows none of) is no outage: no retry
    mends it, so it is raised at the first answer instead of after every retry."""
    import moto.settings

    from raytrain_x.common.errors import StorageError
    from raytrain_x.elastic.checkpoints import open_storage

    uri, _, _ = s3_server
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    storage = open_storage(uri("refused"))
    with pytest.raises(StorageError, match=r"writing s3://refused/runs/a.json failed once: "
                                           r".*ACCESS_DENIED"):
        storage.publish("a.json", b"{}")


def test_a_lease_generation_is_created_once_on_s3(s3_server):
    """S3's conditional PUT (`If-None-Match: *`) orders the lease's generations: the second
    create of one file is refused by the server and the first one's content kept."""
    from raytrain_x.elastic.storage import ArrowStorage

    uri, _, _ = s3_server
    storage = ArrowStorage(uri("leases"))
    assert storage.create("job/lease/000000000001.json", b"first")
    assert not storage.create("job/lease/000000000001.json", b"second")
    assert storage.read("job/lease/000000000001.json") == b"first"


def _rank_0_dies_in_a_fixed_world() -> str:
    """A fixed world of 2 (no elastic driver): rank 0 exits at step 3; rank 1's elastic
    run must stop, saying why, rather than reset forever into a world that cannot form."""
    import raytrain_x.torch as rx

    rx.init()
    model = torch.nn.Linear(4, 2)
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    state = rx.elastic.TorchState(model, opt, step=0)

    @rx.elastic.run
    def train(state):
        while state.step < 50:
            if rx.rank() == 0 and state.step == 3:
                os._exit(1)  # a real crash: no shutdown, its sockets close
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            state.step += 1
            state.commit()

    train(state)
    return "trained on"


def test_a_rank_lost_in_a_fixed_world_stops_the_others_saying_why():
    began = time.monotonic()
    out = run_workers(_rank_0_dies_in_a_fixed_world, 2, allow_failures=True, work_s=60)
    assert isinstance(out[1], str) and "InternalError" in out[1], out[1]
    assert "fixed-size world" in out[1] and "min_workers" in out[1], out[1]
    assert time.monotonic() - began < 60
