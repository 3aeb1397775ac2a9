"""Every storage backend keeps the storage contract (`raytrain_x.testing.storage_contract`):
a local folder through pyarrow, `memory://`, each under the retries, and a backend a user
registers for a scheme of its own. S3 keeps it too, against a real S3-compatible server
(`tests/integration/test_durable.py::test_s3_keeps_the_storage_contract`)."""

from __future__ import annotations

import pytest

from raytrain_x.common.errors import ConfigError
from raytrain_x.elastic.checkpoints import open_storage
from raytrain_x.elastic.storage import ArrowStorage, RetryingStorage
from raytrain_x.elastic.storage_schemes import (
    MemoryStorage,
    open_backend,
    register_storage,
)
from raytrain_x.testing.storage_contract import CLAUSES, check_storage


@pytest.mark.parametrize("kind", ["local", "memory", "local-retrying", "memory-retrying"])
def test_each_backend_keeps_the_storage_contract(tmp_path, kind):
    root = tmp_path / "root"
    storage = ArrowStorage(str(root)) if kind.startswith("local") else \
        open_backend(f"memory://contract-{tmp_path.name}")  # fresh files each run
    if kind.endswith("retrying"):
        storage = RetryingStorage(storage, sleep=lambda _: None)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    assert check_storage(storage, str(scratch)) == [text for text, _ in CLAUSES]


def test_a_broken_backend_is_named_by_the_clause_it_breaks(tmp_path):
    class LastWriterWins(MemoryStorage):  # a create that is not conditional
        def create(self, path, data):
            self.files[path] = bytes(data)
            return True

    with pytest.raises(AssertionError, match="create writes only where no file is"):
        check_storage(LastWriterWins(), str(tmp_path))


def test_a_scheme_opens_the_backend_registered_for_it(tmp_path):
    opened = []

    def factory(path):
        opened.append(path)
        return MemoryStorage(name="mine")

    register_storage("rxtest", factory)
    storage = open_storage("rxtest://bucket/prefix")
    assert opened == ["rxtest://bucket/prefix"]
    storage.publish("a", b"1")  # under the retries
    assert storage.read("a") == b"1"
    assert isinstance(open_backend(str(tmp_path)), ArrowStorage)  # no scheme: pyarrow


def test_memory_storage_of_one_name_is_shared_in_the_process():
    open_backend("memory://shared-name").publish("x", b"seen")
    assert open_backend("memory://shared-name").read("x") == b"seen"
    assert open_backend("memory://other-name").read("x") is None


@pytest.mark.parametrize("scheme", ["", "1abc", "my scheme", "memory"])
def test_a_bad_scheme_is_refused_saying_what_a_scheme_is(scheme):
    with pytest.raises(ConfigError, match="scheme"):
        register_storage(scheme, lambda path: MemoryStorage())
