"""The storage contract of durable checkpoints, on a real local path through the real
writer and store, with faults injected under the retries (`FaultyStorage`): no process,
no framework (each part is a JSON file)."""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path

import pytest

from raytrain_x.common.checkpoint_config import CheckpointConfig, entrypoint_name
from raytrain_x.common.errors import (
    CheckpointError,
    CheckpointLeaseHeld,
    ConfigError,
    StorageError,
)
from raytrain_x.elastic.checkpoints import CheckpointStore, Manifest, checkpoint_folder
from raytrain_x.elastic.checksums import CheckpointDamaged, PartFiles
from raytrain_x.elastic.durable import DurableCheckpoints
from raytrain_x.elastic.lease import RENEW_S, TTL_S, LeaseKeeper, WriterLease
from raytrain_x.elastic.storage import RetryingStorage
from raytrain_x.elastic.storage_faults import write_plan


def _save(tree, folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    Path(folder, "data.json").write_text(json.dumps(tree) + " " * 4096)  # a few KB
    Path(folder, ".metadata").write_text("m" * 200)


def _load(part: PartFiles):
    return json.loads(part.read("data.json"))


@pytest.fixture
def faults(tmp_path, monkeypatch):
    """A fault plan every store opened in this test reads; the retries do not sleep."""
    plan = str(tmp_path / "faults.json")
    write_plan(plan)
    monkeypatch.setenv("RAYTRAIN_X_STORAGE_FAULTS", plan)
    monkeypatch.setattr(RetryingStorage, "FIRST_DELAY_S", 0.0)
    return lambda **kw: write_plan(plan, **kw)


def _writer(path: str, generation: int, owner: str = "run", keep: int = 2,
            takeover: bool = False) -> DurableCheckpoints:
    """Rank 0 of a run (`owner`) holding the job's lease; `takeover`: from a run of this
    same process (as a dead one's would expire)."""
    config = CheckpointConfig(path, name="job", keep=keep, takeover=takeover)
    durable = DurableCheckpoints(config, _save, _load)
    durable.owner = owner
    durable.hold_lease()
    assert durable.generation == generation
    return durable


def _commit(durable: DurableCheckpoints, number: int, step: int) -> Manifest:
    """Writes checkpoint `number` (step `step`) as rank 0 in the background would."""
    manifest = Manifest(number, {}, 1, {"step": step}, 0.0, {}, durable.generation,
                        {"w": [[3], "float32"]})
    durable.write({f"common.{number}": lambda: {"step": step}}, manifest,
                  [f"common.{number}"])
    assert durable.wait(30)
    assert durable.last is not None and durable.last.error is None, durable.last
    return manifest


def _release(durable: DurableCheckpoints) -> None:
    durable.release_lease()


def test_a_failed_listing_is_retried_and_never_reads_as_no_checkpoint(tmp_path, faults):
    first = _writer(str(tmp_path), 1)
    _commit(first, 9, 9)
    _release(first)
    store = CheckpointStore(CheckpointConfig(str(tmp_path), name="job"))
    faults(list=2)  # S3's 503 SlowDown, twice
    assert store.latest().values == {"step": 9}
    faults(list=100)
    with pytest.raises(StorageError, match=r"listing .*/job failed 6 times: .*SlowDown"):
        store.latest()


def test_a_later_run_is_never_pruned_for_an_older_ones_higher_numbers(tmp_path):
    old = _writer(str(tmp_path), 1, owner="old")
    for n in (7, 9):
        _commit(old, n, n)
    _release(old)
    # the next run of the job (its lease expired with its dead holder) counts from 4
    new = _writer(str(tmp_path), 2, owner="new", takeover=True)
    for n in (4, 6):
        _commit(new, n, 100 + n)
    store = new.store
    kept = [(m.generation, m.number) for m in store.checkpoints()]
    assert kept == [(2, 6), (2, 4)]  # run 1's 9 and 7 pruned, not run 2's
    assert store.latest().values == {"step": 106}
    _release(new)


def test_pruning_never_deletes_the_newest_complete_checkpoint(tmp_path):
    durable = _writer(str(tmp_path), 1, keep=1)
    _commit(durable, 3, 3)
    # a later write that never finished (no manifest) and one of a newer run: both kept
    Path(durable.store.where((1, 5)), "common.5").mkdir(parents=True)
    Path(durable.store.where((9, 1)), "common.1").mkdir(parents=True)
    assert durable.store.prune(1, generation=1) == []
    assert [m.number for m in durable.store.checkpoints()] == [3]
    _release(durable)


def _write_failing(durable: DurableCheckpoints, number: int) -> str:
    manifest = Manifest(number, {}, 1, {"step": number}, 0.0, {}, durable.generation)
    durable.write({f"common.{number}": lambda: {"step": number}}, manifest,
                  [f"common.{number}"])
    assert durable.wait(30)
    assert durable.last is not None and durable.last.error is not None
    return durable.last.error


@pytest.mark.parametrize("damage", ["flip", "zero_metadata", "torn"])
def test_a_checkpoint_that_lands_damaged_is_found_by_its_writer_and_never_taken(
        tmp_path, faults, damage):
    durable = _writer(str(tmp_path), 1, keep=1)
    _commit(durable, 2, 2)
    faults(**{damage: 1})  # the next upload lands, then one file is damaged in place
    error = _write_failing(durable, 4)
    damaged = "data.json" if damage != "zero_metadata" else ".metadata"
    assert "landed damaged" in error and f"common.4/{damaged}" in error, error
    store = durable.store
    # it prunes nothing (keep=1: the intact one stays) and no reader takes it
    assert [m.number for m in store.checkpoints()] == [2]
    assert store.latest().number == 2
    _release(durable)


def test_a_checkpoint_damaged_later_is_skipped_for_the_intact_one_before(tmp_path, caplog):
    durable = _writer(str(tmp_path), 1, keep=5)
    _commit(durable, 2, 2)
    newest = _commit(durable, 4, 4)
    store = durable.store
    # a byte flips at the same size on disk after the write (bit rot, a bad copy)
    data = Path(store.where(newest.key, "common.4"), "data.json")
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0x40
    data.write_bytes(bytes(raw))
    assert [m.number for m in store.checkpoints()] == [4, 2]  # by size it looks complete
    with caplog.at_level(logging.WARNING, logger="raytrain_x.elastic"):
        assert store.latest().number == 2
    assert f"{newest.folder}/common.4/data.json is damaged" in caplog.text
    assert [m.number for m in store.checkpoints()] == [2]  # marked: skipped from now on
    _release(durable)


def _flip_a_byte(store: CheckpointStore, manifest: Manifest) -> Path:
    """A byte of `manifest`'s data file flipped at the same size (bit rot, a bad copy)."""
    data = Path(store.where(manifest.key, f"common.{manifest.number}"), "data.json")
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0x40
    data.write_bytes(bytes(raw))
    return data


def test_every_checkpoint_damaged_stops_the_restore_naming_each_and_deletes_nothing(
        tmp_path):
    """With every completed checkpoint damaged, a restore read 'no checkpoint' and the
    job trained from step 0; its first checkpoint then pruned the damaged one. Now the
    reader refuses, naming each checkpoint and why, and says how to start afresh."""
    durable = _writer(str(tmp_path), 1, keep=1)
    only = _commit(durable, 7, 7)
    _release(durable)
    store = CheckpointStore(CheckpointConfig(str(tmp_path), name="job", keep=1))
    _flip_a_byte(store, only)
    Path(store.where((1, 8)), "common.8").mkdir(parents=True)  # a write that never ended
    for _ in range(2):  # found damaged, then found marked
        with pytest.raises(CheckpointError) as refused:
            store.latest()
        text = str(refused.value)
        assert f"{only.folder}/common.7/data.json is damaged" in text or \
            "found damaged before" in text, text
        assert "checkpoint_000001_0000000007" in text and "0000000008" not in text
        assert "CheckpointConfig(name=...)" in text and "Nothing was deleted" in text
    assert store.prune(1, generation=2) == []
    assert Path(store.where(only.key)).is_dir()
    # a job whose only writes never finished has nothing to restore: a fresh start
    fresh = CheckpointStore(CheckpointConfig(str(tmp_path), name="other"))
    Path(fresh.where((1, 1)), "common.1").mkdir(parents=True)
    assert fresh.latest() is None


def test_a_write_that_landed_damaged_is_a_failed_write_not_a_checkpoint(tmp_path, faults):
    """Its writer found it damaged as it finished: nothing was ever restorable from it,
    so a job with only that starts afresh, and pruning deletes it as a failed attempt."""
    durable = _writer(str(tmp_path), 1, keep=1)
    faults(flip=1)
    assert "landed damaged" in _write_failing(durable, 3)
    assert durable.store.latest() is None
    _commit(durable, 5, 5)
    assert [p.name[-2:] for p in Path(durable.store.where()).glob("checkpoint_*")] == \
        ["05"]
    _release(durable)


def test_a_damaged_checkpoint_is_set_aside_never_pruned(tmp_path):
    """keep=2: checkpoint 2 intact, 4 found damaged, then 6, 8 and 10 written. Pruning
    deleted every folder beyond the newest two complete ones; a damaged one is kept (it
    takes no place of `keep`), the intact ones beyond `keep` go."""
    durable = _writer(str(tmp_path), 1, keep=2)
    _commit(durable, 2, 2)
    damaged = _commit(durable, 4, 4)
    store = durable.store
    _flip_a_byte(store, damaged)
    assert store.latest().number == 2  # found damaged: marked
    for number in (6, 8, 10):
        _commit(durable, number, number)
    left = sorted(p.name[-2:] for p in Path(store.where()).glob("checkpoint_*"))
    assert left == ["04", "08", "10"], left
    _release(durable)


def test_a_read_cut_off_midway_goes_on_from_where_it_stopped(tmp_path, faults,
                                                             monkeypatch):
    """A read that failed partway through a file was neither retried nor a StorageError
    (only opening it and its first chunk were): the restoring rank died of the raw error.
    Now each cut-off read goes on from the byte it reached, and one that keeps failing
    is a StorageError naming the file."""
    from raytrain_x.elastic import storage as storage_module

    monkeypatch.setattr(storage_module, "CHUNK", 500)  # the 4 KB data file in 9 reads
    durable = _writer(str(tmp_path), 1)
    _commit(durable, 3, 3)
    _release(durable)
    store = CheckpointStore(CheckpointConfig(str(tmp_path), name="job"))
    faults(midway=3)  # three connection resets, each after a chunk
    assert store.latest().number == 3  # every checksum right: nothing read twice
    faults(midway=100)
    with pytest.raises(StorageError, match=r"reading .*common\.3/\S+ failed 6 times: "
                                           r".*Connection reset"):
        store.latest()


def test_a_checkpoint_read_back_intact_is_complete_though_pruning_fails(tmp_path, faults,
                                                                         caplog):
    """Pruning (every delete refused: S3's 503) runs after the checkpoint is published and
    read back: it was reported as a failed checkpoint, though complete. Now it is a
    warning, and the next checkpoint prunes what was left."""
    durable = _writer(str(tmp_path), 1, keep=1)
    _commit(durable, 2, 2)
    faults(delete=100)
    with caplog.at_level(logging.WARNING, logger="raytrain_x.elastic"):
        _commit(durable, 4, 4)  # asserts the write reported no error
    assert "is complete; older checkpoints were not pruned" in caplog.text
    assert [m.number for m in durable.store.checkpoints()] == [4, 2]
    faults()
    _commit(durable, 6, 6)
    assert [m.number for m in durable.store.checkpoints()] == [6]
    _release(durable)


def test_failed_attempts_leave_nothing_behind_while_failures_last(tmp_path, faults):
    """Six failed attempts (a full disk) left six copies beside the complete checkpoint,
    keeping the disk full. Each attempt's writer now deletes what it wrote."""
    durable = _writer(str(tmp_path), 1, keep=1)
    _commit(durable, 2, 2)
    faults(full_disk=True)
    for number in (3, 4, 5):
        assert "No space left on device" in _write_failing(durable, number)
    faults()
    assert [p.name[-2:] for p in Path(durable.store.where()).glob("checkpoint_*")] == \
        ["02"]
    _release(durable)


def test_a_full_disk_fails_the_write_at_once_and_names_the_path(tmp_path, faults):
    durable = _writer(str(tmp_path), 1)
    faults(full_disk=True)
    manifest = Manifest(3, {}, 1, {}, 0.0, {}, 1)
    durable.write({"common.3": lambda: {}}, manifest, ["common.3"])
    assert durable.wait(30)
    assert durable.last.error is not None
    assert "No space left on device" in durable.last.error
    assert "failed once" in durable.last.error  # no retry mends a full disk
    _release(durable)


def test_the_clean_up_of_a_write_storage_failed_is_tried_once(tmp_path, faults):
    """Storage that stops answering fails the write once its retries are spent; what the
    writer does after (marking its part failed, deleting what it wrote) is tried once: on
    S3 a retried clean-up held the writer, and the commit waiting on it, for about four
    times the write's own retries."""
    durable = _writer(str(tmp_path), 1)
    many = 100
    faults(write=many, delete=many)  # S3 refusing every write and delete
    manifest = Manifest(3, {}, 1, {}, 0.0, {}, 1)
    durable.write({"common.3": lambda: {}}, manifest, ["common.3"])
    assert durable.wait(30)
    assert "failed 6 times" in durable.last.error  # the upload: every retry
    plan = json.loads(Path(os.environ["RAYTRAIN_X_STORAGE_FAULTS"]).read_text())
    # one upload tried ATTEMPTS times, then one try at marking the part failed; one try
    # each at deleting the part's folder and the checkpoint's
    assert many - plan["write"] == RetryingStorage.ATTEMPTS + 1
    assert many - plan["delete"] == 2
    faults()
    _release(durable)


def test_a_checkpoint_is_complete_only_with_a_checksum_per_file(tmp_path):
    durable = _writer(str(tmp_path), 1)
    manifest = _commit(durable, 1, 1)
    raw = json.loads(Path(durable.store.where(manifest.key), "manifest.json").read_text())
    files = raw["parts"]["common.1"]
    assert set(files) == {"data.json", ".metadata"}
    assert all(len(checksum) == 32 for _, checksum in files.values())
    assert raw["checksum"] == "xxh3_128" and raw["generation"] == 1
    assert not list(Path(durable.store.where(manifest.key)).glob("*.tmp-*"))
    _release(durable)


def test_a_second_run_is_refused_while_the_first_holds_the_lease(tmp_path):
    first = _writer(str(tmp_path), 1, owner="first")
    store = CheckpointStore(CheckpointConfig(str(tmp_path), name="job"))
    with pytest.raises(CheckpointLeaseHeld, match="another run of this job is writing"):
        WriterLease(store, "second").acquire()
    # taking over fences the first: its next manifest is refused
    assert WriterLease(store, "second").acquire(takeover=True) == 2
    first.write({"common.5": lambda: {}}, Manifest(5, {}, 1, {}, 0.0, {}, 1), ["common.5"])
    assert first.wait(30)
    assert "no longer holds the writer lease" in first.last.error
    assert store.checkpoints() == []
    _release(first)


def test_a_lease_is_refused_while_renewed_taken_once_renewals_stop_on_the_readers_clock(
        tmp_path):
    """Liveness is whether the holder's file changes, timed on the reader's own clock: the
    holder's wall clock, skewed either way, changes nothing."""
    store = CheckpointStore(CheckpointConfig(str(tmp_path), name="job"))
    holder = WriterLease(store, "a")
    holder.acquire()
    lease_file = Path(tmp_path, "job", "lease", "000000000001.json")
    now = [1000.0]
    slept: list[float] = []

    def skew(seconds: float) -> None:  # the holder's clock is off by `seconds`
        record = json.loads(lease_file.read_text())
        record["wall_time"] += seconds
        lease_file.write_text(json.dumps(record))

    def renewing(seconds: float) -> None:  # the holder renews while the reader watches
        slept.append(seconds)
        now[0] += seconds
        holder.renew()
        skew(-20.0)

    skew(-20.0)  # 20 s behind, renewing: refused, after one renewal
    other = WriterLease(store, "b", clock=lambda: now[0], sleep=renewing)
    with pytest.raises(CheckpointLeaseHeld, match="another run of this job is writing"):
        other.acquire()
    assert sum(slept) <= RENEW_S
    slept.clear()

    def stopped(seconds: float) -> None:  # the holder is dead: its file does not change
        slept.append(seconds)
        now[0] += seconds

    skew(80.0)  # 60 s ahead and dead: taken after TTL_S on the reader's clock, not 75 s
    other = WriterLease(store, "b", clock=lambda: now[0], sleep=stopped)
    assert other.acquire() == 2
    assert sum(slept) == pytest.approx(TTL_S)
    # a holder on this host whose process is gone holds nothing, at once; nor does one
    # whose training ended (released)
    record = json.loads(Path(tmp_path, "job", "lease", "000000000002.json").read_text())
    record.update(pid=_dead_pid(), host=socket.gethostname())
    Path(tmp_path, "job", "lease", "000000000002.json").write_text(json.dumps(record))
    slept.clear()
    third = WriterLease(store, "c", clock=lambda: now[0], sleep=stopped)
    assert third.acquire() == 3 and slept == []
    third.release()
    assert WriterLease(store, "d", clock=lambda: now[0], sleep=stopped).acquire() == 4
    assert slept == []
    assert sorted(p.name for p in Path(tmp_path, "job", "lease").iterdir()) == \
        ["000000000003.json", "000000000004.json"]  # older generations forgotten


class _Interleaved:
    """A storage that runs `first()` just before its `method` does (an order of
    events made to happen: another run acts inside this one's call)."""

    def __init__(self, inner, method: str, first) -> None:
        self._inner, self._method, self._first = inner, method, first

    def __getattr__(self, name: str):
        call = getattr(self._inner, name)
        if name != self._method:
            return call

        def interleaved(*args, **kwargs):
            self._first()
            return call(*args, **kwargs)
        return interleaved


def test_a_renewal_landing_after_a_takeover_never_undoes_it(tmp_path):
    """The old run's renewal checked the lease, then a run started with takeover=True took
    it, then the old renewal's write landed: the new run still holds the lease and the old
    one is fenced (a renewal writes only its own generation's file)."""
    old = WriterLease(CheckpointStore(CheckpointConfig(str(tmp_path), name="job")), "old")
    assert old.acquire() == 1
    new = WriterLease(CheckpointStore(CheckpointConfig(str(tmp_path), name="job")), "new")
    took: list[int] = []
    old.store.storage = _Interleaved(old.store.storage, "publish",
                                     lambda: took.append(new.acquire(takeover=True)))
    old.renew()  # its check passes; the takeover lands; then its write
    assert took == [2]
    new.check()
    with pytest.raises(CheckpointLeaseHeld, match=r"generation 1\) no longer holds"):
        old.check()
    assert new.holder().owner == "new"


def test_two_runs_taking_one_generation_in_the_same_instant_one_is_refused(tmp_path):
    """Storage orders them: the second create of a generation's file fails."""
    config = CheckpointConfig(str(tmp_path), name="job")
    first = WriterLease(CheckpointStore(config), "first")
    second = WriterLease(CheckpointStore(config), "second")
    won: list[int] = []
    second.store.storage = _Interleaved(second.store.storage, "create",
                                        lambda: won.append(first.acquire()))
    with pytest.raises(CheckpointLeaseHeld, match="took the writer lease .* in the same "
                                                   "instant"):
        second.acquire()
    assert won == [1]
    first.check()
    assert first.holder().owner == "first"


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_a_path_that_cannot_be_written_fails_the_probe_naming_it(tmp_path):
    from raytrain_x.elastic.checkpoints import probe

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(StorageError, match=r"cannot be written at .*a-file/job"):
        probe(CheckpointConfig(str(blocker), name="job"))


def test_one_folder_rule_absolute_paths_and_names_from_the_command(tmp_path, monkeypatch):
    monkeypatch.delenv("RAYTRAIN_X_CHECKPOINT_NAME", raising=False)
    monkeypatch.chdir(tmp_path)
    config = CheckpointConfig("~/ckpt").named("given")
    assert config.storage_path == os.path.expanduser("~/ckpt") and config.name == "given"
    assert CheckpointConfig("rel").named(None).storage_path == str(tmp_path / "rel")
    a = entrypoint_name(["train.py", "--lr", "0.1"], "/w")
    assert a == entrypoint_name(["train.py", "--lr", "0.1"], "/w")  # the same command
    assert a.startswith("train-")
    assert a != entrypoint_name(["train.py", "--lr", "0.2"], "/w")  # another experiment
    assert entrypoint_name(["/k/ipykernel_launcher.py", "-f", "k1.json"], "/w") == \
        entrypoint_name(["/k/ipykernel_launcher.py", "-f", "k2.json"], "/w")
    monkeypatch.setenv("RAYTRAIN_X_CHECKPOINT_NAME", "from-the-driver")
    assert CheckpointConfig("/x").named(None).name == "from-the-driver"


COPY = "/tmp/ray/session_{}/runtime_resources/working_dir_files/_ray_pkg_{}"


def test_a_relative_path_is_the_drivers_on_every_worker(tmp_path, monkeypatch):
    """A worker of a RayExecutor job runs in Ray's copy of the working directory: a
    relative `CheckpointConfig("ckpts")` given there was made absolute in that copy,
    which Ray deletes. It is the driver's working directory's, as on the driver."""
    worker_cwd = tmp_path / COPY.format("w", "1a2b").lstrip("/")
    worker_cwd.mkdir(parents=True)
    monkeypatch.chdir(worker_cwd)
    monkeypatch.setenv("RAYTRAIN_X_DRIVER_DIR", str(tmp_path / "project"))
    assert CheckpointConfig("ckpts").named("job").storage_path == \
        str(tmp_path / "project" / "ckpts")
    assert CheckpointConfig("/abs/ckpts").named("job").storage_path == "/abs/ckpts"
    assert CheckpointConfig("s3://b/p").named("job").storage_path == "s3://b/p"
    # a driver that itself runs in Ray's copy (`ray job submit --working-dir`): refused
    monkeypatch.setenv("RAYTRAIN_X_DRIVER_DIR", COPY.format("d", "9f9f"))
    with pytest.raises(ConfigError, match=r"'ckpts'\) is relative, and this job runs in "
                                          r"Ray's copy .* give an absolute path"):
        CheckpointConfig("ckpts").named("job")


def test_a_submitted_jobs_name_holds_across_head_restarts_and_edited_files(monkeypatch):
    """An unnamed `ray job submit` job's folder hashed its working directory: Ray's copy,
    named by the session and the files' hash, so a head restart or an edited file started
    the same command afresh. Where it runs inside the copy is what counts now."""
    argv = ["train.py", "--lr", "0.1"]
    first = entrypoint_name(argv, COPY.format("2026-12-01_10-00-00", "aaaa"))
    assert first == entrypoint_name(argv, COPY.format("2026-12-06_17-30-00", "bbbb"))
    assert first != entrypoint_name(argv, COPY.format("s", "bbbb") + "/sub")
    assert first != entrypoint_name(["train.py", "--lr", "0.2"], COPY.format("s", "aaaa"))


def test_older_single_number_folders_are_generation_0(tmp_path):
    from raytrain_x.elastic.checkpoints import parse_folder

    assert parse_folder("checkpoint_0000000042") == (0, 42)
    assert parse_folder(checkpoint_folder(3, 42)) == (3, 42)
    assert parse_folder("checkpoint_x") is None


def test_a_round_restores_the_named_checkpoint_or_one_its_writer_completed_since(
        tmp_path, caplog):
    """The driver names the checkpoint when it forms the round. A holder's background write
    that completes after that (as the holders are lost) holds later steps of the same job:
    the restore takes it, or it would lose them (the simulator found this: a round restored
    60 while 62 had completed 1.7 s before the workers read). Damaged, the named one is
    found so as it is read, set aside, and the next pick is the newest one before it."""
    durable = _writer(str(tmp_path), 1, keep=5)
    for n in (2, 4):
        _commit(durable, n, n)
    assert durable.named((1, 4)).number == 4
    _commit(durable, 6, 6)  # completed after the driver named 4
    with caplog.at_level(logging.INFO, logger="raytrain_x.elastic"):
        assert durable.named((1, 4)).number == 6
    assert "completed after the driver named checkpoint (1, 4)" in caplog.text
    for n in (4, 6):
        data = Path(durable.store.where((1, n), f"common.{n}"), "data.json")
        raw = bytearray(data.read_bytes())
        raw[10] ^= 0x40
        data.write_bytes(bytes(raw))
    set_aside = []
    with caplog.at_level(logging.WARNING, logger="raytrain_x.elastic"):
        while True:
            manifest = durable.named((1, 4))
            try:
                durable.load(manifest, f"common.{manifest.number}")
                break
            except CheckpointDamaged as exc:
                durable.set_aside(manifest, str(exc))
                set_aside.append(manifest.number)
    assert set_aside == [6, 4] and manifest.number == 2
    assert "common.4/data.json is damaged" in caplog.text
    _release(durable)


def test_a_write_waiting_for_a_part_whose_rank_was_lost_is_given_up_at_the_next_sync(
        tmp_path):
    """Rank 0's background write waits for every rank's part (`write_timeout_s` 600 s).
    After the world changed, a part a rank of the new world still writes is waited for
    and completes the checkpoint; a part no rank writes any more (its rank was lost
    mid-write) gives the write up at once, naming it, and its attempt is deleted."""
    config = CheckpointConfig(str(tmp_path), name="job", write_timeout_s=600)
    durable = DurableCheckpoints(config, _save, _load)
    durable.owner = "run"
    durable.hold_lease()

    def start(number: int) -> Manifest:
        manifest = Manifest(number, {}, 2, {"step": number}, 0.0, {}, durable.generation)
        durable.write({f"common.{number}": lambda: {"step": number}}, manifest,
                      [f"common.{number}", f"shard_00001.{number}"])
        return manifest

    survived = start(3)
    durable.world_changed({"shard_00001.3"})  # a rank of the new world still writes it
    assert not durable.wait(0.6)
    _save({"shard": 1}, str(tmp_path / "part"))
    durable.store.upload(survived.key, "shard_00001.3", str(tmp_path / "part"))
    assert durable.wait(30) and durable.last.error is None
    assert [m.number for m in durable.store.checkpoints()] == [3]

    lost = start(5)
    durable.world_changed(set())  # nobody writes shard_00001.5 any more
    assert durable.wait(5)
    assert "no rank of the new world writes shard_00001" in durable.last.error
    assert not Path(durable.store.where(lost.key)).exists()
    _release(durable)


def test_the_driver_keeps_its_runs_lease_after_rank_0_is_gone(tmp_path):
    """Rank 0 took the lease and its process is gone (on this machine); the driver's
    keeper renews the lease for the run, so a second run is refused at the keeper's next
    renewal, not given the lease at once. The keeper takes and renews nothing that is not
    its run's; its stop (the run ended) releases the lease for the next run at once."""
    store = CheckpointStore(CheckpointConfig(str(tmp_path), name="job"))
    keeper = LeaseKeeper(store, "run-1")
    keeper.renew()  # rank 0 has not taken it yet: nothing written
    assert not Path(tmp_path, "job", "lease").exists()
    WriterLease(store, "run-1", driver=keeper.lease.driver).acquire()
    lease_file = Path(tmp_path, "job", "lease", "000000000001.json")
    record = json.loads(lease_file.read_text())
    record["pid"] = _dead_pid()  # rank 0's process is gone; the driver (this one) is not
    lease_file.write_text(json.dumps(record))
    now = [0.0]

    def renewing(seconds: float) -> None:
        now[0] += seconds
        keeper.renew()

    with pytest.raises(CheckpointLeaseHeld, match="another run of this job is writing"):
        WriterLease(store, "run-2", clock=lambda: now[0], sleep=renewing).acquire()
    assert now[0] <= RENEW_S
    keeper.stop()  # the run ended
    assert json.loads(lease_file.read_text())["released"]

    def no_wait(seconds: float) -> None:
        raise AssertionError("a released lease is taken at once")

    assert WriterLease(store, "run-3", sleep=no_wait).acquire() == 2
    taken = Path(tmp_path, "job", "lease", "000000000002.json").read_text()
    keeper.renew()  # another run's lease: not touched
    assert Path(tmp_path, "job", "lease", "000000000002.json").read_text() == taken
