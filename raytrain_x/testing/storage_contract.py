"""The contract a durable storage backend (`raytrain_x.elastic.storage.Storage`) keeps, as
checks a backend's own tests run: `check_storage(storage, scratch)` goes through every
clause on a fresh root and raises `AssertionError` naming the first one broken.

raytrain-x's checkpoints rely on each clause: a listing that says a checkpoint is there, a
ranged read that resumes a cut-off read, an atomic publish (a manifest is whole or absent),
a create that only one of two writers wins (the writer lease's generations), copies in and
out of local folders (DCP parts), deletes that leave nothing (pruning)."""

from __future__ import annotations

import os
from collections.abc import Callable

from raytrain_x.elastic.storage import Storage

CLAUSES: list[tuple[str, Callable[[Storage, str], None]]] = []


def clause(text: str) -> Callable:
    def add(check: Callable[[Storage, str], None]) -> Callable[[Storage, str], None]:
        CLAUSES.append((text, check))
        return check
    return add


def check_storage(storage: Storage, scratch: str) -> list[str]:
    """Runs every clause against `storage` (an empty root) with `scratch`, an empty local
    folder; returns the clauses checked.

    Raises:
        AssertionError: "<clause>: <what was seen>" for the first clause broken.
    """
    checked = []
    for text, check in CLAUSES:
        folder = os.path.join(scratch, f"clause{len(checked)}")
        os.makedirs(folder)
        try:
            check(storage, folder)
        except AssertionError as exc:
            raise AssertionError(f"{text}: {exc}") from None
        checked.append(text)
    return checked


@clause("what is not there reads as missing, not as an error")
def _missing(storage: Storage, scratch: str) -> None:
    assert storage.read("nothing/here") is None
    assert storage.sizes(["nothing/here"]) == [None]
    assert storage.list("nothing") == []
    storage.delete("nothing")  # deleting what is gone is no error
    storage.delete_file("nothing/here")


@clause("a published file reads back whole, and a second publish replaces it")
def _publish(storage: Storage, scratch: str) -> None:
    storage.publish("pub/a.json", b"first")
    assert storage.read("pub/a.json") == b"first"
    storage.publish("pub/a.json", b"second, longer")
    assert storage.read("pub/a.json") == b"second, longer"
    assert storage.sizes(["pub/a.json", "pub/b.json"]) == [len(b"second, longer"), None]


@clause("create writes only where no file is, and says whether it did")
def _create(storage: Storage, scratch: str) -> None:
    assert storage.create("lease/gen-1", b"mine") is True
    assert storage.create("lease/gen-1", b"theirs") is False
    assert storage.read("lease/gen-1") == b"mine"


@clause("a listing names a folder's children once each, folders as folders, files sized")
def _list(storage: Storage, scratch: str) -> None:
    storage.publish("tree/one", b"1")
    storage.publish("tree/sub/two", b"22")
    storage.publish("tree/sub/deeper/three", b"333")
    children = {e.name: e for e in storage.list("tree")}
    assert sorted(children) == ["one", "sub"], sorted(children)
    assert not children["one"].is_dir and children["one"].size == 1, children["one"]
    assert children["sub"].is_dir, children["sub"]
    assert sorted(e.name for e in storage.list("tree/sub")) == ["deeper", "two"]


@clause("chunks read a range, and reading on from where a read stopped gives the rest")
def _chunks(storage: Storage, scratch: str) -> None:
    data = bytes(range(256)) * 64
    storage.publish("ranged/blob", data)
    assert b"".join(storage.chunks("ranged/blob")) == data
    assert b"".join(storage.chunks("ranged/blob", 1000, 500)) == data[1000:1500]
    assert b"".join(storage.chunks("ranged/blob", 1000)) == data[1000:]


@clause("a local folder uploaded and downloaded again comes back file for file")
def _copies(storage: Storage, scratch: str) -> None:
    source = os.path.join(scratch, "source")
    os.makedirs(os.path.join(source, "nested"))
    files = {"a.distcp": b"a" * 3000, os.path.join("nested", ".metadata"): b"meta"}
    for name, data in files.items():
        with open(os.path.join(source, name), "wb") as f:
            f.write(data)
    storage.upload(source, "copies/part")
    assert storage.read("copies/part/nested/.metadata") == b"meta"
    target = os.path.join(scratch, "target")
    storage.download("copies/part", target)
    for name, data in files.items():
        with open(os.path.join(target, name), "rb") as f:
            assert f.read() == data, name


@clause("deleting a folder deletes everything under it and nothing beside it")
def _delete(storage: Storage, scratch: str) -> None:
    storage.publish("del/gone/x", b"x")
    storage.publish("del/gone/deep/y", b"y")
    storage.publish("del/kept/z", b"z")
    storage.delete("del/gone")
    assert storage.read("del/gone/x") is None and storage.read("del/gone/deep/y") is None
    assert [e.name for e in storage.list("del")] == ["kept"]
    storage.delete_file("del/kept/z")
    assert storage.read("del/kept/z") is None


@clause("a path written in place where the storage is local reads back through it")
def _local(storage: Storage, scratch: str) -> None:
    where = storage.local("inplace/file")
    assert storage.describe("inplace/file").endswith("inplace/file")
    if where is None:  # an object store: nothing is written in place
        return
    os.makedirs(os.path.dirname(where), exist_ok=True)
    with open(where, "wb") as f:
        f.write(b"in place")
    assert storage.read("inplace/file") == b"in place"
