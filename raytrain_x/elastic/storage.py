"""Durable checkpoints in storage: the folders, their parts and the manifest that makes one
complete (no framework, no Ray).

Storage is opened through `pyarrow.fs`, as Ray opens `RunConfig(storage_path=...)`: a local
or shared path, S3, GCS. A job's checkpoints live under `storage_path/name/`:

    checkpoint_0000000042/        one per durable commit, numbered by commit
      common/                     a part: files of one writer (a torch DCP checkpoint...)
      shard_00001/
      common.json, shard_00001.json   each part's file list and sizes, once uploaded
      manifest.json               written last: the checkpoint is complete

A reader takes the newest checkpoint whose manifest parses and whose every listed file
exists at its size; others are skipped with a warning (cut off mid-write, corrupted).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from raytrain_x.common.checkpoint_config import CheckpointConfig
from raytrain_x.common.errors import ConfigError

log = logging.getLogger("raytrain_x.elastic")

_PREFIX = "checkpoint_"
MANIFEST = "manifest.json"


@dataclass
class Manifest:
    """A complete checkpoint, as its manifest describes it."""

    number: int  # the commit it holds (the job's commits, counted over its whole life)
    parts: dict[str, dict[str, int]]  # part -> {file (relative to the part): bytes}
    world_size: int
    values: dict[str, Any] = field(default_factory=dict)  # plain attributes (step, epoch)
    written_at: float = 0.0  # the writer's wall clock when the manifest was written
    info: dict[str, Any] = field(default_factory=dict)  # the framework's own (layout)

    @property
    def folder(self) -> str:
        return checkpoint_folder(self.number)

    def describe(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self.values.items()) or "no attributes"
        return f"checkpoint {self.number} ({shown}, {self.world_size} workers)"


def latest_checkpoint(config: CheckpointConfig) -> dict[str, Any]:
    """What the driver says of the checkpoint a restore will take: its number, attributes
    and description (number None when none is found or storage cannot be read)."""
    try:
        manifest = CheckpointStore(config).latest(warn=False)
    except Exception as exc:  # noqa: BLE001 - the workers look again, and say why
        return {"number": None, "describe": f"storage not readable: {exc}"}
    if manifest is None:
        return {"number": None, "describe": "none found"}
    return {"number": manifest.number, "describe": manifest.describe(),
            "values": manifest.values}


def checkpoint_folder(number: int) -> str:
    return f"{_PREFIX}{number:010d}"


def _open(storage_path: str) -> tuple[Any, str]:
    try:
        import pyarrow.fs as pafs
    except ImportError:  # pragma: no cover - the checkpoint extra installs it
        raise ConfigError("durable checkpoints need pyarrow: pip install "
                          "'raytrain-x[checkpoint]'") from None
    if "://" in storage_path:
        try:
            return pafs.FileSystem.from_uri(storage_path)
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds
            raise ConfigError(f"CheckpointConfig(storage_path={storage_path!r}) cannot be "
                              f"opened: {exc}") from None
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(storage_path))


class CheckpointStore:
    """One job's checkpoint folders in storage (`CheckpointConfig.storage_path/name`)."""

    def __init__(self, config: CheckpointConfig) -> None:
        if config.name is None:
            raise ValueError("CheckpointConfig.named() settles the name first")
        self.config = config
        self.fs, base = _open(config.storage_path)
        self.root = f"{base.rstrip('/')}/{config.name}"

    def where(self, number: int, part: str = "") -> str:
        path = f"{self.root}/{checkpoint_folder(number)}"
        return f"{path}/{part}" if part else path

    # ------------------------------------------------------------------ writing
    def local_folder(self, number: int, part: str) -> str | None:
        """Where a part can be written in place: storage on this machine's file system (a
        local or shared folder); None for object stores, which take `upload`."""
        import pyarrow.fs as pafs

        return self.where(number, part) if isinstance(self.fs, pafs.LocalFileSystem) else None

    def upload(self, number: int, part: str, local_dir: str) -> dict[str, int]:
        """Copies the part's files from `local_dir` (unless it is the part's own folder,
        written in place) and records them (`part.json`); returns {file: bytes}."""
        import pyarrow.fs as pafs

        files = {}
        for folder, _, names in os.walk(local_dir):
            for file in names:
                path = os.path.join(folder, file)
                files[os.path.relpath(path, local_dir)] = os.path.getsize(path)
        dest = self.where(number, part)
        if os.path.abspath(local_dir) != dest:
            self.fs.create_dir(dest, recursive=True)
            pafs.copy_files(local_dir, dest, source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=self.fs)
        self._write_json(f"{self.where(number)}/{part}.json", files)
        return files

    def parts_done(self, number: int, parts: list[str]) -> dict[str, dict[str, int]]:
        """The parts among `parts` whose upload has been recorded."""
        done = {}
        for part in parts:
            files = self._read_json(f"{self.where(number)}/{part}.json")
            if files is not None:
                done[part] = files
        return done

    def wait_for_parts(self, number: int, parts: list[str], timeout_s: float,
                       sleep: Callable[[float], None] = time.sleep,
                       ) -> dict[str, dict[str, int]] | None:
        """Every part's file list once all are recorded, else None after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            done = self.parts_done(number, parts)
            if len(done) == len(parts):
                return done
            if time.monotonic() > deadline:
                return None
            sleep(0.2)

    def complete(self, manifest: Manifest) -> None:
        """Writes the manifest: from now on the checkpoint is visible to readers."""
        self._write_json(f"{self.where(manifest.number)}/{MANIFEST}", {
            "number": manifest.number, "parts": manifest.parts,
            "world_size": manifest.world_size, "values": manifest.values,
            "written_at": manifest.written_at, "info": manifest.info})

    def prune(self, keep: int) -> list[int]:
        """Deletes complete checkpoints beyond the newest `keep`, and incomplete ones older
        than the newest complete one (writes given up). Returns the numbers deleted."""
        complete = [m.number for m in self.checkpoints()]
        if not complete:
            return []
        kept = set(complete[:keep])
        doomed = [n for n in self._numbers() if n not in kept and n < complete[0]]
        for number in doomed:
            self.fs.delete_dir(self.where(number))
        return doomed

    # ------------------------------------------------------------------ reading
    def checkpoints(self, warn: bool = False) -> list[Manifest]:
        """The complete checkpoints, newest first. With `warn`, each folder skipped (no
        manifest, or a listed file missing or of another size) is logged."""
        return list(self._complete(warn))

    def latest(self, warn: bool = True) -> Manifest | None:
        """The newest complete checkpoint (the ones after it that are not, skipped)."""
        return next(self._complete(warn), None)

    def _complete(self, warn: bool) -> Iterator[Manifest]:
        """The complete checkpoints, newest first, each checked only when asked for."""
        for number in sorted(self._numbers(), reverse=True):
            manifest, why = self._check(number)
            if manifest is not None:
                yield manifest
            elif warn:
                log.warning("raytrain-x checkpoint: skipping %s: %s; trying the one before",
                            self.where(number), why)

    def download(self, manifest: Manifest, part: str, local_dir: str) -> str:
        """Copies a part's files into `local_dir/part`; returns that folder."""
        import pyarrow.fs as pafs

        dest = os.path.join(local_dir, part)
        os.makedirs(dest, exist_ok=True)
        pafs.copy_files(self.where(manifest.number, part), dest, source_filesystem=self.fs,
                        destination_filesystem=pafs.LocalFileSystem())
        return dest

    def _numbers(self) -> list[int]:
        import pyarrow.fs as pafs

        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        except OSError as exc:
            log.warning("raytrain-x checkpoint: cannot list %s: %s", self.root, exc)
            return []
        numbers = []
        for info in infos:
            name = info.base_name
            if info.type == pafs.FileType.Directory and name.startswith(_PREFIX):
                try:
                    numbers.append(int(name[len(_PREFIX):]))
                except ValueError:
                    continue
        return numbers

    def _check(self, number: int) -> tuple[Manifest | None, str]:
        import pyarrow.fs as pafs

        raw = self._read_json(f"{self.where(number)}/{MANIFEST}")
        if raw is None:
            return None, "no manifest (the write did not finish)"
        try:
            manifest = Manifest(int(raw["number"]), dict(raw["parts"]),
                                int(raw["world_size"]), dict(raw.get("values", {})),
                                float(raw.get("written_at", 0.0)), dict(raw.get("info", {})))
        except (KeyError, TypeError, ValueError) as exc:
            return None, f"its manifest is not valid ({exc!r})"
        paths = [f"{self.where(number, part)}/{file}"
                 for part, files in manifest.parts.items() for file in files]
        sizes = [n for files in manifest.parts.values() for n in files.values()]
        infos = self.fs.get_file_info(paths) if paths else []
        for path, size, info in zip(paths, sizes, infos):
            if info.type != pafs.FileType.File or info.size != size:
                return None, f"{path} is missing or not {size} bytes"
        return manifest, ""

    def _write_json(self, path: str, value: Any) -> None:
        with self.fs.open_output_stream(path) as out:
            out.write(json.dumps(value).encode())

    def _read_json(self, path: str) -> Any:
        try:
            with self.fs.open_input_stream(path) as f:
                return json.loads(f.read().decode())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            if "not found" in str(exc).lower() or "does not exist" in str(exc).lower():
                return None
            log.debug("raytrain-x checkpoint: %s unreadable: %s", path, exc)
            return {"unreadable": str(exc)} if path.endswith(MANIFEST) else None
