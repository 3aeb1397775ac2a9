"""A torch part's files are hashed as torch DCP writes them: the checksums a manifest
records, with no second read of the files (`raytrain_x.torch.durable.save`)."""

from __future__ import annotations

import os

import pytest
import torch

from raytrain_x.common.checkpoint_config import CheckpointConfig
from raytrain_x.elastic import checkpoints
from raytrain_x.elastic.checkpoints import CheckpointStore, file_checksum
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
    for name, (size, checksum) in hashed.items():
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
