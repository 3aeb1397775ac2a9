"""How a checkpoint's bytes are checked against what its manifest records, whole files or
pieces of them, as they are read (no framework, no Ray).

A manifest records each file of a part as `[bytes, checksum]` or `[bytes, checksum,
pieces]`: the checksum is the xxh3-128 of the whole file; the pieces, `[[bytes,
checksum], ...]` in file order from its first byte, are the stretches a writer hashed
apart as it wrote them (torch DCP's items: `raytrain_x.torch.durable.save`). A reader of
one item reads those bytes alone (a ranged read on an object store) and checks each piece
they hold; a reader of a whole file checks the whole file's checksum. Nothing is read
twice to be checked, and no byte reaches the caller unchecked.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Iterator
from typing import Any

from raytrain_x.common.errors import CheckpointError, ConfigError
from raytrain_x.elastic.storage import Storage

CHECKSUM = "xxh3_128"
RUN_BYTES = 64 * 1024 * 1024  # the most `PartFiles.read_ranges` reads in one request


class CheckpointDamaged(CheckpointError):
    """A file of a checkpoint read back is not what its manifest records (another
    checksum or size): the checkpoint is damaged, and the one before it is taken."""


def new_hasher() -> Any:
    """A running xxh3-128 hash (`update`, `hexdigest`): what manifests record."""
    try:
        import xxhash
    except ImportError:  # pragma: no cover - the checkpoint extra installs it
        raise ConfigError("durable checkpoints need xxhash: pip install "
                          "'raytrain-x[checkpoint]'") from None
    return xxhash.xxh3_128()


def bytes_checksum(data: bytes) -> str:
    """The xxh3-128 checksum of `data`."""
    digest = new_hasher()
    digest.update(data)
    return digest.hexdigest()


def file_checksum(path: str) -> str:
    """The xxh3-128 checksum of a local file."""
    digest = new_hasher()
    with open(path, "rb") as f:
        while chunk := f.read(8 * 1024 * 1024):
            digest.update(chunk)
    return digest.hexdigest()


def pieces_of(record: list[Any]) -> list[tuple[int, int, str | None]]:
    """A file record's pieces as (offset, bytes, checksum); one piece, the whole file,
    where the writer recorded none (or pieces that do not add up to the file)."""
    whole = [(0, int(record[0]), record[1])]
    if len(record) < 3 or not record[2]:
        return whole
    out, at = [], 0
    for size, checksum in record[2]:
        out.append((at, int(size), checksum))
        at += int(size)
    return out if at == int(record[0]) else whole


class PartFiles:
    """One part of a complete checkpoint, read through storage with every byte checked
    against the manifest as it is read: whole files, or a file's range that starts and
    ends where its pieces do (a ranged read of those bytes alone). A range its pieces do
    not bound (a file written without pieces) is served from the whole file, read once
    and checked.

    Raises (each read):
        CheckpointDamaged: a piece or file is not what the manifest records (naming it).
        StorageError: storage failed the read after its retries.
    """

    def __init__(self, storage: Storage, folder: str, files: dict[str, list[Any]]) -> None:
        self.storage, self.folder, self.files = storage, folder, files
        self._whole: dict[str, bytes] = {}
        self._pieces: dict[str, tuple[list[tuple[int, int, str | None]], dict[int, int]]] = {}

    def names(self) -> list[str]:
        return sorted(self.files)

    def describe(self, file: str = "") -> str:
        return self.storage.describe(f"{self.folder}/{file}" if file else self.folder)

    def read(self, file: str, keep: bool = False) -> bytes:
        """A whole file, checked (with `keep`, kept: read again, it is not read twice)."""
        if file in self._whole:
            return self._whole[file]
        out = io.BytesIO()
        for chunk in self.chunks(file):
            out.write(chunk)
        if keep:
            self._whole[file] = out.getvalue()
        return out.getvalue()

    def read_range(self, file: str, offset: int, length: int) -> bytes:
        """`length` bytes of `file` from `offset`, checked piece by piece."""
        if file not in self._pieces:
            pieces = pieces_of(self._record(file))
            self._pieces[file] = pieces, {at: i for i, (at, _, _) in enumerate(pieces)}
        pieces, index = self._pieces[file]
        end = offset + length
        first, last = index.get(offset), index.get(end, len(pieces) if end == int(
            self._record(file)[0]) else None)
        if first is not None and last is not None:
            return b"".join(self._checked(file, offset, length, pieces[first:last],
                                          hold=True))
        # not bounded by pieces (written without them): the whole file, read once
        return self.read(file, keep=True)[offset:end]

    def read_ranges(self, ranges: Iterable[tuple[str, int, int]]) -> dict[tuple[str, int], bytes]:
        """The bytes of each (file, offset, length) in `ranges`, by (file, offset), each
        checked piece by piece: ranges that follow one another in a file are read together,
        in one read of up to `RUN_BYTES` (one request to an object store, not one per
        item), and no byte outside them is read."""
        out: dict[tuple[str, int], bytes] = {}
        run: list[tuple[str, int, int]] = []

        def flush() -> None:
            if run:
                file, start = run[0][0], run[0][1]
                data = self.read_range(file, start, run[-1][1] + run[-1][2] - start)
                for _, offset, length in run:
                    out[(file, offset)] = data[offset - start:offset - start + length]
                run.clear()

        for file, offset, length in sorted(set(ranges)):
            joins = run and run[-1][0] == file and run[-1][1] + run[-1][2] == offset and \
                offset + length - run[0][1] <= RUN_BYTES
            if not joins:
                flush()
            run.append((file, offset, length))
        flush()
        return out

    def chunks(self, file: str) -> Iterator[memoryview]:
        """A whole file a chunk at a time, checked against the whole file's checksum once
        its last byte went by: what was yielded counts only where no error follows."""
        record = self._record(file)
        yield from self._checked(file, 0, int(record[0]),
                                 [(0, int(record[0]), record[1])], hold=False)

    def copy_to(self, local_dir: str) -> str:
        """Every file of the part copied into `local_dir`, checked as it is copied (a
        damaged one raises, its copy left for the caller's temporary folder to go with);
        returns `local_dir`."""
        for file in self.names():
            dest = os.path.join(local_dir, file)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(dest, "wb") as out:
                for chunk in self.chunks(file):
                    out.write(chunk)
        return local_dir

    def _record(self, file: str) -> list[Any]:
        record = self.files.get(file)
        if record is None:
            raise CheckpointDamaged(f"{self.describe(file)} is not in the checkpoint's "
                                    "manifest")
        return record

    def _checked(self, file: str, offset: int, length: int,
                 pieces: Iterable[tuple[int, int, str | None]], hold: bool
                 ) -> Iterator[memoryview]:
        """The bytes of `file` from `offset`, `length` of them, which `pieces` cover
        exactly, each piece checked. With `hold`, a piece's bytes are yielded only once it
        matched; without, as they come (the error follows its last byte)."""
        path = f"{self.folder}/{file}"
        stream = self.storage.chunks(path, offset, length)
        pending, used = memoryview(b""), 0  # the chunk read last, and how much of it went
        for at, size, checksum in pieces:
            digest, held, need = new_hasher(), [], size
            while need:
                if used == len(pending):
                    pending, used = memoryview(next(stream, b"")), 0
                    if not pending:
                        raise CheckpointDamaged(
                            f"{self.describe(file)} ends before byte {at + size} (its "
                            f"manifest says {int(self._record(file)[0])} bytes)")
                take = pending[used:used + need]
                used += len(take)
                need -= len(take)
                digest.update(take)
                if hold:
                    held.append(take)
                else:
                    yield take
            if checksum is not None and digest.hexdigest() != checksum:
                where = "" if (at, size) == (0, int(self._record(file)[0])) else \
                    f" (bytes {at}-{at + size})"
                raise CheckpointDamaged(f"{self.describe(file)} is damaged{where} (checksum "
                                        f"{digest.hexdigest()}, its manifest says "
                                        f"{checksum})")
            yield from held
