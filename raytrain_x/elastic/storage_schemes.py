"""Durable storage chosen by a path's scheme: `memory://NAME` (files in this process's
memory, for tests and the simulator), a scheme a backend registered
(`register_storage`), else `pyarrow.fs` (a local or shared path, `s3://`, `gs://`,
`hdfs://`, S3-compatible servers), as Ray opens `RunConfig(storage_path=...)`.

A backend is a `Storage` (`raytrain_x.elastic.storage`): files under a root, listed, read
whole or in ranges, published atomically, created only where none is, copied in and out of
local folders, deleted. `raytrain_x.testing.storage_contract.check_storage` holds one to
that contract; a new backend runs it in its own tests.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from raytrain_x.common.errors import ConfigError
from raytrain_x.common.process import PROCESS
from raytrain_x.elastic.storage import ArrowStorage, Entry, Storage

StorageFactory = Callable[[str], Storage]

# scheme -> how a path of it is opened (code, registered at import: not state)
_SCHEMES: dict[str, StorageFactory] = {}


def register_storage(scheme: str, factory: StorageFactory) -> None:
    """Opens checkpoint paths `scheme://...` with `factory(path)`, a `Storage`. Register it
    in every process that opens the storage (the driver and each worker): at the import of
    the module that defines the backend, which the training function imports too.

    Raises:
        ConfigError: `scheme` is not a URI scheme (letters, digits, `+`, `-`, `.`), or is
            `memory`, which raytrain-x's in-memory storage holds.
    """
    scheme = scheme.lower()
    if not scheme or not scheme[0].isalpha() or \
            not all(c.isalnum() or c in "+-." for c in scheme):
        raise ConfigError(f"register_storage needs a URI scheme (s3, myfs, ...), got "
                          f"{scheme!r}")
    if scheme == "memory" and factory is not memory_storage:
        raise ConfigError("the scheme 'memory' is raytrain-x's in-memory storage: "
                          "register the backend under a scheme of its own")
    _SCHEMES[scheme] = factory


def scheme_of(path: str) -> str:
    """The URI scheme of a checkpoint path ('' for a local path)."""
    return path.split("://", 1)[0].lower() if "://" in path else ""


def open_backend(path: str) -> Storage:
    """The storage of a checkpoint path, by its scheme (no retries: `open_storage` adds
    them)."""
    factory = _SCHEMES.get(scheme_of(path))
    return factory(path) if factory is not None else ArrowStorage(path)


class MemoryStorage(Storage):
    """Files in a dict, by path: `memory://NAME` opens this process's files of NAME
    (every store opened on it sees the same files), `MemoryStorage()` files of its own."""

    def __init__(self, files: dict[str, bytes] | None = None, name: str = "") -> None:
        self.files: dict[str, bytes] = {} if files is None else files
        self.name = name

    def describe(self, path: str = "") -> str:
        return f"memory://{self.name}/{path}" if self.name else f"memory://{path}"

    def list(self, folder: str) -> list[Entry]:
        prefix = f"{folder}/" if folder else ""
        children: dict[str, Entry] = {}
        for path, data in list(self.files.items()):
            if path.startswith(prefix):
                name, _, rest = path[len(prefix):].partition("/")
                children[name] = Entry(name, bool(rest), 0 if rest else len(data))
        return list(children.values())

    def read(self, path: str) -> bytes | None:
        return self.files.get(path)

    def chunks(self, path: str, offset: int = 0, length: int | None = None
               ) -> Iterator[bytes]:
        if path not in self.files:
            raise FileNotFoundError(self.describe(path))
        end = None if length is None else offset + length
        return iter([self.files[path][offset:end]])

    def sizes(self, paths: list[str]) -> list[int | None]:
        return [len(self.files[p]) if p in self.files else None for p in paths]

    def publish(self, path: str, data: bytes) -> None:
        self.files[path] = bytes(data)

    def create(self, path: str, data: bytes) -> bool:
        data = bytes(data)
        return self.files.setdefault(path, data) is data  # one step: two callers, one wins

    def upload(self, local_dir: str, folder: str) -> None:
        for root, _, names in os.walk(local_dir):
            for name in names:
                full = os.path.join(root, name)
                relative = os.path.relpath(full, local_dir).replace(os.sep, "/")
                with open(full, "rb") as f:
                    self.files[f"{folder}/{relative}"] = f.read()

    def download(self, folder: str, local_dir: str) -> None:
        prefix = f"{folder}/"
        for path, data in list(self.files.items()):
            if path.startswith(prefix):
                target = os.path.join(local_dir, *path[len(prefix):].split("/"))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as f:
                    f.write(data)

    def delete(self, folder: str) -> None:
        for path in [p for p in self.files if p.startswith(f"{folder}/")]:
            del self.files[path]

    def delete_file(self, path: str) -> None:
        self.files.pop(path, None)

    def local(self, path: str) -> str | None:
        return None


def memory_storage(path: str) -> MemoryStorage:
    """`memory://NAME[/prefix]`: this process's files of NAME (made on first use)."""
    name = path.split("://", 1)[1].strip("/")
    with PROCESS.lock:
        files = PROCESS.memory_files.setdefault(name, {})
    return MemoryStorage(files, name)


register_storage("memory", memory_storage)
