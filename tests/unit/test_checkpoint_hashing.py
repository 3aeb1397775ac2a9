"""A torch part's files are hashed as torch DCP writes them: the checksums a manifest
records, with no second read of the files (`raytrain_x.torch.durable.save`)."""

from __future__ import annotations

import os

import pytest
import torch

from raytrain_x.common.checkpoint_config import CheckpointConfig
from raytrain_x.elastic import checkpoints
from raytrain_x.elastic.checkpoints import CheckpointStore
from raytrain_x.elastic.checksums import file_checksum
from raytrain_x.torch.durable import load, save


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_part_is_hashed_as_written_and_never_read_again(tmp_path, monkeypatch):
    tree = {"model": {"big": torch.randn(600, 1000), "small": torch.arange(5)},
            "attributes": {"step": 7}}
    folder = tmp_path / "part"
    hashed = save(tree, str(folder))
    on_disk = {os.path.relpath(os.path.join(d, f), folder)
               for d, _, names in os.walk(folder) for f in names}
    assert set(hashed) == on_disk and ".metadata" in hashed  # every file, the renamed one too
    for name, (size, checksum, *_) in hashed.items():
        path = str(folder / name)
        assert size == os.path.getsize(path) and checksum == file_checksum(path), name
    reread: list[str] = []
    monkeypatch.setattr(checkpoints, "file_checksum",
                        lambda path: reread.append(path) or file_checksum(path))
    store = CheckpointStore(CheckpointConfig(str(tmp_path / "store"), name="job"))
    assert store.upload((1, 1), "common.1", str(folder), hashed) == hashed
    assert reread == []
    # a file the writer could not hash (absent from `hashed`) is hashed after
    partial = dict(hashed)
    partial.pop(".metadata")
    assert store.upload((1, 2), "common.2", str(folder), partial) == hashed
    assert [os.path.basename(p) for p in reread] == [".metadata"]
    back = load(str(folder))
    assert torch.equal(back["model"]["big"], tree["model"]["big"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_each_item_is_a_piece_a_reader_reads_alone_and_checks(tmp_path):
    """A restore read every shard part whole on every rank, and rank 0 the whole
    checkpoint once more to check it: a whole file's checksum cannot check a range. Now
    each DCP item is a piece with its own checksum, recorded as it is written; a reader
    reads its items' bytes alone (ranged reads) and checks each, so damage in another
    rank's item is not its to find, and damage in its own is found, named, as it reads."""
    from torch.distributed.checkpoint import FileSystemReader

    from raytrain_x.elastic.checksums import CheckpointDamaged, PartFiles
    from raytrain_x.elastic.storage import ArrowStorage, bytes_read
    from raytrain_x.torch.durable import load_shards

    torch.manual_seed(0)
    tree = {"rank": 1, "shards": {"opt": {i: {"step": torch.tensor(3.0),
                                              "exp_avg": torch.randn(200, 100)}
                                          for i in range(4)}}}
    folder = tmp_path / "part"
    files = save(tree, str(folder))
    [data] = [f for f in files if f.endswith(".distcp")]
    items = sorted((i.offset, i.length) for i in
                   FileSystemReader(str(folder)).read_metadata().storage_data.values())
    offsets = [0]
    for size, _ in files[data][2]:
        offsets.append(offsets[-1] + size)
    assert [(a, b - a) for a, b in zip(offsets, offsets[1:])] == items  # a piece an item
    part = PartFiles(ArrowStorage(str(tmp_path)), "part", files)
    before = bytes_read()
    mine = load_shards(part, lambda name, i: i == 1)
    read = bytes_read() - before
    assert torch.equal(mine["opt"][1]["exp_avg"], tree["shards"]["opt"][1]["exp_avg"])
    total = sum(entry[0] for entry in files.values())
    assert read < 0.3 * total  # one item of four, its metadata and skeleton

    reader = FileSystemReader(str(folder))
    storage_data = reader.read_metadata().storage_data
    [item] = [v for k, v in storage_data.items() if k.fqn == "state.shards.opt.2.exp_avg"]
    raw = bytearray((folder / data).read_bytes())
    raw[item.offset + item.length // 2] ^= 0x40  # rank 2's item damaged at its size
    (folder / data).write_bytes(bytes(raw))
    fresh = PartFiles(ArrowStorage(str(tmp_path)), "part", files)
    assert torch.equal(load_shards(fresh, lambda name, i: i == 1)["opt"][1]["exp_avg"],
                       tree["shards"]["opt"][1]["exp_avg"])
    with pytest.raises(CheckpointDamaged, match=rf"part/{data} is damaged \(bytes "
                                                 rf"{item.offset}-{item.offset + item.length}"):
        load_shards(fresh, lambda name, i: i == 2)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_items_that_follow_one_another_are_read_in_one_request(tmp_path):
    """Reading items alone made one request per item: a model of many small tensors took
    as many GETs from an object store. Items a load reads that follow one another in a
    file are read in one request, still checked piece by piece."""
    from raytrain_x.elastic.checksums import PartFiles
    from raytrain_x.elastic.storage import ArrowStorage, bytes_read, reads_made

    tree = {"model": {f"w{i}": torch.randn(50) for i in range(40)}, "attributes": {"step": 3}}
    files = save(tree, str(tmp_path / "part"))
    part = PartFiles(ArrowStorage(str(tmp_path)), "part", files)
    before, read = reads_made(), bytes_read()
    back = load(part)
    assert all(torch.equal(back["model"][k], v) for k, v in tree["model"].items())
    # the metadata (read once, kept), the skeleton, then the 40 tensors in one run
    assert reads_made() - before == 3
    assert bytes_read() - read == sum(entry[0] for entry in files.values())
