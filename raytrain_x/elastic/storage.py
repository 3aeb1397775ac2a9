"""Durable storage: the interface a job's checkpoints are written through, its one real
implementation over `pyarrow.fs`, and the retries every operation goes through (no
framework, no Ray).

In the spirit of torch DCP's `StorageWriter`/`StorageReader`, storage knows files, not
checkpoints: list a folder, read and write a file, publish a file atomically, copy a folder
in and out, delete a folder. Paths are relative to the storage's root. What makes a
checkpoint complete is `raytrain_x.elastic.checkpoints`'s.

`raytrain_x.elastic.checkpoints.open_storage` gives `RetryingStorage(ArrowStorage)`; with
`RAYTRAIN_X_STORAGE_FAULTS` set (tests, the simulator) a `FaultyStorage`
(`storage_faults.py`) sits under the retries, so that an injected fault meets the same
retries a real one does.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from raytrain_x.common.checkpoint_config import absolute_path
from raytrain_x.common.errors import ConfigError, StorageError
from raytrain_x.common.process import PROCESS

log = logging.getLogger("raytrain_x.elastic")

T = TypeVar("T")
CHUNK = 8 * 1024 * 1024  # bytes read at a time to checksum or copy


def bytes_read() -> int:
    """The bytes this process has read from storage (files read, streamed or copied out;
    a local folder read in place by torch DCP is not counted): what a restore costs."""
    return PROCESS.storage_bytes_read


def reads_made() -> int:
    """The reads (requests: a GET, ranged or whole, on an object store) this process made
    of storage's files."""
    return PROCESS.storage_reads


@dataclass(frozen=True)
class Entry:
    """One child of a listed folder."""

    name: str
    is_dir: bool
    size: int


class Storage(ABC):
    """Files under one root (`describe(path)` says where, for messages)."""

    @abstractmethod
    def describe(self, path: str = "") -> str:
        """The full path or URI of `path`."""

    @abstractmethod
    def list(self, folder: str) -> list[Entry]:
        """`folder`'s children; [] when it does not exist."""

    @abstractmethod
    def read(self, path: str) -> bytes | None:
        """A file's bytes; None when it does not exist."""

    @abstractmethod
    def chunks(self, path: str, offset: int = 0, length: int | None = None
               ) -> Iterator[bytes]:
        """A file's bytes from byte `offset` on (up to `length` of them: a ranged read on
        an object store), a chunk at a time (to checksum it without holding it; a read cut
        off midway goes on from where it stopped)."""

    @abstractmethod
    def sizes(self, paths: list[str]) -> list[int | None]:
        """Each file's size; None where it is missing or not a file."""

    @abstractmethod
    def publish(self, path: str, data: bytes) -> None:
        """Writes a small file atomically and durably: a reader sees all of it or none (a
        rename after an fsync on a file system; an object store's PUT)."""

    @abstractmethod
    def create(self, path: str, data: bytes) -> bool:
        """Writes a small file only where none is at `path`, atomically: True when this
        call made it, False when a file was there (a conditional write; what orders the
        writer lease's generations)."""

    @abstractmethod
    def upload(self, local_dir: str, folder: str) -> None:
        """Copies a local folder's files to `folder` (a no-op copy where `local_dir` is
        `local(folder)`), durable when it returns."""

    @abstractmethod
    def download(self, folder: str, local_dir: str) -> None:
        """Copies `folder`'s files into the local folder `local_dir`."""

    @abstractmethod
    def delete(self, folder: str) -> None:
        """Deletes a folder and everything in it (nothing when it is gone)."""

    @abstractmethod
    def delete_file(self, path: str) -> None:
        """Deletes one file (nothing when it is gone)."""

    @abstractmethod
    def local(self, path: str) -> str | None:
        """Where `path` can be written in place on this machine (a local or shared file
        system); None for object stores."""

    def once(self) -> Storage:
        """This storage with each operation tried once: for what is done on a best-effort
        basis after a failure (the storage that failed a write is likely to fail its
        clean-up too, and a retried clean-up would hold the writer for its whole retry
        budget again). Storage without retries of its own is itself."""
        return self


def _not_found(exc: BaseException) -> bool:
    if isinstance(exc, FileNotFoundError):
        return True
    text = str(exc).lower()
    return "not found" in text or "does not exist" in text or "nosuchkey" in text


class ArrowStorage(Storage):
    """Storage through `pyarrow.fs`, as Ray opens `RunConfig(storage_path=...)`: a local or
    shared path, S3, GCS, S3-compatible servers."""

    def __init__(self, storage_path: str) -> None:
        try:
            import pyarrow.fs as pafs
        except ImportError:  # pragma: no cover - the checkpoint extra installs it
            raise ConfigError("durable checkpoints need pyarrow: pip install "
                              "'raytrain-x[checkpoint]'") from None
        self._pafs = pafs
        if "://" in storage_path:
            try:
                self.fs, base = pafs.FileSystem.from_uri(storage_path)
            except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds
                raise ConfigError(f"the checkpoint path {storage_path!r} (--checkpoint-path, "
                                  f"CheckpointConfig(storage_path=...)) cannot be opened: "
                                  f"{exc}") from None
        else:
            self.fs, base = pafs.LocalFileSystem(), absolute_path(storage_path)
        self.base = base.rstrip("/")
        self.is_local = isinstance(self.fs, pafs.LocalFileSystem)
        self.uri = storage_path if "://" in storage_path else self.base
        self._conditional: Callable[[str, bytes], bool] | None = None

    def _at(self, path: str) -> str:
        return f"{self.base}/{path}" if path else self.base

    def describe(self, path: str = "") -> str:
        if self.is_local:
            return self._at(path)
        scheme = self.uri.split("://", 1)[0]
        return f"{scheme}://{self._at(path)}"

    def list(self, folder: str) -> list[Entry]:
        pafs = self._pafs
        infos = self.fs.get_file_info(pafs.FileSelector(self._at(folder),
                                                        allow_not_found=True))
        return [Entry(i.base_name, i.type == pafs.FileType.Directory, i.size or 0)
                for i in infos]

    def read(self, path: str) -> bytes | None:
        try:
            PROCESS.storage_reads += 1
            with self.fs.open_input_stream(self._at(path)) as f:
                data = f.read()
            PROCESS.storage_bytes_read += len(data)
            return data
        except OSError as exc:
            if _not_found(exc):
                return None
            raise

    def chunks(self, path: str, offset: int = 0, length: int | None = None
               ) -> Iterator[bytes]:
        left = -1 if length is None else length
        PROCESS.storage_reads += 1
        with self.fs.open_input_file(self._at(path)) as f:  # ranged reads on a store
            if offset:
                f.seek(offset)
            while left:
                chunk = f.read(CHUNK if left < 0 else min(CHUNK, left))
                if not chunk:
                    return
                PROCESS.storage_bytes_read += len(chunk)
                left -= len(chunk) if left > 0 else 0
                yield chunk

    def sizes(self, paths: list[str]) -> list[int | None]:
        if not paths:
            return []
        infos = self.fs.get_file_info([self._at(p) for p in paths])
        return [i.size if i.type == self._pafs.FileType.File else None for i in infos]

    def publish(self, path: str, data: bytes) -> None:
        full = self._at(path)
        if not self.is_local:
            self.fs.create_dir(full.rsplit("/", 1)[0], recursive=True)
            with self.fs.open_output_stream(full) as out:  # one PUT: atomic
                out.write(data)
            return
        tmp = _durable_temp(full, data)
        try:
            os.replace(tmp, full)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        _fsync_dir(os.path.dirname(full))

    def create(self, path: str, data: bytes) -> bool:
        full = self._at(path)
        if self.is_local:
            tmp = _durable_temp(full, data)
            try:
                os.link(tmp, full)  # O_EXCL's guarantee (NFS too), the content whole
            except FileExistsError:
                return False
            finally:
                os.remove(tmp)
            _fsync_dir(os.path.dirname(full))
            return True
        if self._conditional is None:
            self._conditional = conditional_put(self.uri)
        self.fs.create_dir(full.rsplit("/", 1)[0], recursive=True)  # the bucket, where new
        return self._conditional(full, data)

    def upload(self, local_dir: str, folder: str) -> None:
        dest = self._at(folder)
        if self.is_local:
            if os.path.abspath(local_dir) != dest:
                os.makedirs(dest, exist_ok=True)  # several ranks may copy into one folder
                self._pafs.copy_files(local_dir, dest,
                                      source_filesystem=self._pafs.LocalFileSystem(),
                                      destination_filesystem=self.fs)
            _fsync_tree(dest)
            return
        self.fs.create_dir(dest, recursive=True)
        self._pafs.copy_files(local_dir, dest, source_filesystem=self._pafs.LocalFileSystem(),
                              destination_filesystem=self.fs)

    def download(self, folder: str, local_dir: str) -> None:
        os.makedirs(local_dir, exist_ok=True)
        self._pafs.copy_files(self._at(folder), local_dir, source_filesystem=self.fs,
                              destination_filesystem=self._pafs.LocalFileSystem())
        PROCESS.storage_bytes_read += sum(os.path.getsize(os.path.join(d, f))
                                          for d, _, names in os.walk(local_dir) for f in names)

    def delete(self, folder: str) -> None:
        try:
            self.fs.delete_dir(self._at(folder))
        except OSError as exc:
            if not _not_found(exc):
                raise

    def delete_file(self, path: str) -> None:
        try:
            self.fs.delete_file(self._at(path))
        except OSError as exc:
            if not _not_found(exc):
                raise

    def local(self, path: str) -> str | None:
        return self._at(path) if self.is_local else None


def conditional_put(uri: str) -> Callable[[str, bytes], bool]:
    """For an object store: a function that PUTs `bucket/key` only where no object is
    (S3's `If-None-Match: *`, through boto3, at the endpoint, region and keys the URI
    gives pyarrow). A store without conditional writes (or without boto3) gets a read
    then a write: two runs creating in the same instant may both succeed, and the
    lease's read back refuses the one whose write landed first."""
    from urllib.parse import parse_qs, urlparse

    parsed = urlparse(uri)
    try:
        import boto3
        import botocore.exceptions as boto_errors
    except ImportError:
        boto3 = None
    if parsed.scheme != "s3" or boto3 is None:
        log.warning("raytrain-x storage: %s offers no conditional write here (S3 with boto3 "
                    "does): the writer lease's generations are created by a read then a "
                    "write", uri.split("?")[0])
        return _read_then_write(uri)
    query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
    endpoint = query.get("endpoint_override")
    if endpoint and "://" not in endpoint:
        endpoint = f"{query.get('scheme', 'https')}://{endpoint}"
    client = boto3.client(
        "s3", endpoint_url=endpoint, region_name=query.get("region"),
        aws_access_key_id=query.get("access_key"),
        aws_secret_access_key=query.get("secret_key"),
        aws_session_token=query.get("session_token"))

    def put(full: str, data: bytes) -> bool:
        bucket, _, key = full.partition("/")
        try:
            client.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
        except boto_errors.ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status in (409, 412):  # there, or created at the same instant
                return False
            raise OSError(f"conditional PUT of {full}: {exc}") from exc
        except boto_errors.BotoCoreError as exc:  # unreachable, timed out: retried
            raise OSError(f"conditional PUT of {full}: {exc}") from exc
        return True
    return put


def _read_then_write(uri: str) -> Callable[[str, bytes], bool]:
    storage = ArrowStorage(uri)

    def put(full: str, data: bytes) -> bool:
        path = full[len(storage.base) + 1:]
        if storage.read(path) is not None:
            return False
        storage.publish(path, data)
        return True
    return put


def _durable_temp(full: str, data: bytes) -> str:
    """`data` in a new file beside `full` (its folder made), fsynced: what a rename or a
    hard link then puts in `full`'s place whole. Returns its path."""
    os.makedirs(os.path.dirname(full), exist_ok=True)
    tmp = f"{full}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        with open(tmp, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return tmp


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    """Every file under `root`, then every folder, on disk (before a manifest names them)."""
    for folder, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(folder)
    _fsync_dir(os.path.dirname(root))


# errors no retry mends: a full disk, no permission, a file where a folder should be
_LASTING = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS,
            errno.ENOTDIR, errno.EEXIST)
# an object store's answers no retry mends: credentials refused, access denied (pyarrow's
# S3 and GCS errors carry the status as text, without an errno)
_LASTING_STATUS = re.compile(r"HTTP status (401|403)\b|AWS Error (ACCESS_DENIED|"
                             r"INVALID_ACCESS_KEY_ID|SIGNATURE_DOES_NOT_MATCH)\b|"
                             r"AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch")


def lasting(exc: OSError) -> bool:
    """Whether no retry mends `exc` (a full disk, a missing permission)."""
    return getattr(exc, "errno", None) in _LASTING or \
        bool(_LASTING_STATUS.search(str(exc)))


class RetryingStorage(Storage):
    """Every operation of `inner` retried with exponential backoff on an `OSError` (S3's
    503 SlowDown, a flaky NFS mount), up to `ATTEMPTS` tries and `BUDGET_S` seconds in all
    (pyarrow's S3 client retries inside each try too: about 6 s before it gives one up),
    then raised as a `StorageError` naming the operation, the path and the cause. A missing
    file is an answer, not an error: never retried; a full disk, a missing permission or
    a file in a folder's place are raised at once."""

    ATTEMPTS = 6
    BUDGET_S = 15.0
    FIRST_DELAY_S = 0.1
    MAX_DELAY_S = 2.0

    def __init__(self, inner: Storage, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.inner, self._sleep, self._clock = inner, sleep, clock

    def _retry(self, what: str, path: str, call: Callable[[], T]) -> T:
        backoff = self._backoff(what, path)
        while True:
            try:
                return call()
            except OSError as exc:
                backoff(exc)

    def _backoff(self, what: str, path: str) -> Callable[[OSError], None]:
        """The function a try of `what` on `path` calls with its error: it waits before
        the next try, or raises the `StorageError` once the tries or the time are spent
        (at once for a lasting error)."""
        delay, attempt = self.FIRST_DELAY_S, 0
        deadline = self._clock() + self.BUDGET_S

        def failed(exc: OSError) -> None:
            nonlocal delay, attempt
            attempt += 1
            spent = attempt == self.ATTEMPTS or self._clock() + delay > deadline
            if lasting(exc) or spent:
                tries = "once" if attempt == 1 else f"{attempt} times"
                raise StorageError(f"{what} {self.inner.describe(path)} failed {tries}: "
                                   f"{str(exc).splitlines()[0][:300] or type(exc).__name__}"
                                   ) from exc
            log.info("raytrain-x storage: %s %s failed (%s); retrying in %.1fs", what,
                     self.inner.describe(path), exc, delay)
            self._sleep(delay)
            delay = min(delay * 2, self.MAX_DELAY_S)
        return failed

    def describe(self, path: str = "") -> str:
        return self.inner.describe(path)

    def once(self) -> Storage:
        return self.inner.once()

    def list(self, folder: str) -> list[Entry]:
        return self._retry("listing", folder, lambda: self.inner.list(folder))

    def read(self, path: str) -> bytes | None:
        return self._retry("reading", path, lambda: self.inner.read(path))

    def chunks(self, path: str, offset: int = 0, length: int | None = None
               ) -> Iterator[bytes]:
        # a read that fails, at its start or midway, is tried again from the byte it
        # reached, under the same backoff as every operation
        backoff = self._backoff("reading", path)
        while True:
            try:
                for chunk in self.inner.chunks(path, offset, length):
                    offset += len(chunk)
                    if length is not None:
                        length -= len(chunk)
                    yield chunk
                return
            except OSError as exc:
                backoff(exc)

    def sizes(self, paths: list[str]) -> list[int | None]:
        return self._retry("looking up", paths[0] if paths else "",
                           lambda: self.inner.sizes(paths))

    def publish(self, path: str, data: bytes) -> None:
        self._retry("writing", path, lambda: self.inner.publish(path, data))

    def create(self, path: str, data: bytes) -> bool:
        return self._retry("creating", path, lambda: self.inner.create(path, data))

    def upload(self, local_dir: str, folder: str) -> None:
        self._retry("writing", folder, lambda: self.inner.upload(local_dir, folder))

    def download(self, folder: str, local_dir: str) -> None:
        self._retry("reading", folder, lambda: self.inner.download(folder, local_dir))

    def delete(self, folder: str) -> None:
        self._retry("deleting", folder, lambda: self.inner.delete(folder))

    def delete_file(self, path: str) -> None:
        self._retry("deleting", path, lambda: self.inner.delete_file(path))

    def local(self, path: str) -> str | None:
        return self.inner.local(path)
