"""`CheckpointConfig`: where and how often an elastic job writes durable checkpoints.

Pure data, shared by the driver (which passes it to its workers through one environment
variable) and the workers (which write and read the checkpoints).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from raytrain_x.common.errors import ConfigError
from raytrain_x.common.settings import CHECKPOINT, CHECKPOINT_NAME, DRIVER_DIR


@dataclass(frozen=True)
class CheckpointConfig:
    """Durable checkpoints of an elastic job's committed state, written in the background.

    The job's latest commit is written to `storage_path/name/` every `every_s` seconds by
    a background thread (the step does not wait). When every worker holding the committed
    state in memory is lost, or when the same command runs again after the driver died,
    the job resumes from the latest complete checkpoint at whatever world size it has.

    Args:
        storage_path: a local or shared path, or a URI that `pyarrow.fs` opens (as Ray's
            `RunConfig(storage_path=...)`): `s3://bucket/prefix`, `gs://bucket/prefix`;
            S3-compatible servers take `?endpoint_override=host:port&scheme=http`.
        name: the job's folder under `storage_path`; the same name resumes the same job.
            Default, the same rule at every entry point: the job's name where one was
            given (`RayExecutor(name=...)`, `raytrain-x run --job-name`,
            `RAYTRAIN_X_JOB_NAME`), else a Tune trial's name, else one made from the
            command that started the job (`entrypoint_name`): the same command run again
            resumes, another command (other arguments) starts afresh.
        every_s: seconds between checkpoints (counted from the start of the last write;
            a write still under way when the next is due makes that one wait for the next
            commit after it ends).
        keep: how many complete checkpoints to keep (older ones are deleted once a newer
            one is complete).
        write_timeout_s: how long the checkpoint's last writer waits for the other ranks'
            parts before it gives that checkpoint up (a warning; training goes on).
        takeover: take the job's writer lease over from a run that still holds it (its
            checkpoints are then refused), instead of refusing to start (`lease.py`).
    """

    storage_path: str
    name: str | None = None
    every_s: float = 300.0
    keep: int = 2
    write_timeout_s: float = 600.0
    takeover: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.storage_path, str) or not self.storage_path.strip():
            raise ConfigError(f"CheckpointConfig(storage_path=...) must be a non-empty path "
                              f"or URI (a local folder, s3://bucket/prefix), got "
                              f"{self.storage_path!r}")
        if self.name is not None and (not isinstance(self.name, str) or not self.name
                                      or "/" in self.name or self.name in (".", "..")):
            raise ConfigError(f"CheckpointConfig(name=...) must be a folder name without "
                              f"'/', got {self.name!r}")
        for field, low in (("every_s", 0.0), ("write_timeout_s", 0.0)):
            value = getattr(self, field)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value <= low):
                raise ConfigError(f"CheckpointConfig({field}=...) must be a number of "
                                  f"seconds > 0, got {value!r}")
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
            raise ConfigError(f"CheckpointConfig(keep=...) must be an int >= 1 (complete "
                              f"checkpoints kept), got {self.keep!r}")
        if not isinstance(self.takeover, bool):
            raise ConfigError(f"CheckpointConfig(takeover=...) must be True or False, got "
                              f"{self.takeover!r}")

    def named(self, job_name: str | None) -> CheckpointConfig:
        """This config with its folder's name settled (its own, else `job_name`, else the
        one the driver settled for its workers, else this process's command's) and a
        local path made absolute."""
        path = absolute_path(self.storage_path)
        name = self.name or job_name or CHECKPOINT_NAME.read() or entrypoint_name()
        return replace(self, storage_path=path, name=folder_name(name))

    def to_env(self) -> dict[str, str]:
        """The environment variable that gives a worker this config."""
        return {CHECKPOINT.env: json.dumps(asdict(self))}


# where Ray unpacks a job's working directory (`runtime_env={"working_dir": ...}`, `ray job
# submit --working-dir`): a copy named by its content's hash, in the session's folder
RAY_PACKAGE_COPY = re.compile(r"^.*/runtime_resources/[a-z_]+_files/_ray_pkg_[^/]+")


def driver_dir() -> str:
    """The driver's working directory: this process's, unless a driver above it gave its
    own (`DRIVER_DIR`: a worker, or a driver started inside one, as a Tune trial's)."""
    return DRIVER_DIR.read() or os.getcwd()


def absolute_path(storage_path: str) -> str:
    """A local path made absolute (`~` expanded); URIs as they are. A relative path is the
    driver's: taken against the driver's working directory, on the driver and on every
    worker (`DRIVER_DIR`), never a worker's own (Ray's copy of the working directory,
    which Ray deletes).

    Raises:
        ConfigError: the path is relative and the driver itself runs in Ray's copy of
            the job's working directory (`ray job submit --working-dir`).
    """
    if "://" in storage_path:
        return storage_path
    path = os.path.expanduser(storage_path)
    if os.path.isabs(path):
        return os.path.normpath(path)
    base = driver_dir()
    if RAY_PACKAGE_COPY.search(base):
        raise ConfigError(
            f"CheckpointConfig(storage_path={storage_path!r}) is relative, and this job runs "
            f"in Ray's copy of its working directory ({base}), which Ray deletes when the "
            "job ends: give an absolute path on storage every node sees, or a URI "
            "(s3://bucket/prefix)")
    return os.path.abspath(os.path.join(base, path))


def folder_name(name: str) -> str:
    """`name` as one folder's name: characters other than letters, digits, `.`, `-` and
    `_` become `_`."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", name).strip(".") or "job"
    return cleaned[:120]


def entrypoint_name(argv: Sequence[str] | None = None, cwd: str | None = None) -> str:
    """The folder of a job nobody named, made from the command that started it: the
    script's name and a hash of the whole command line and the working directory
    (`train-1f2e3d4c`), so the same command run again finds the same folder and another
    one (another learning rate as a flag) another. A notebook's kernel has no command of
    its own: its working directory stands for it (`notebook-...`)."""
    argv = list(sys.argv if argv is None else argv)
    cwd = os.getcwd() if cwd is None else cwd
    # in Ray's copy of a submitted working directory the folder is named by the session
    # and the files' hash: the same command must find its folder after a head restart or
    # an edited file, so only where it runs inside the copy counts
    cwd = RAY_PACKAGE_COPY.sub("<ray working_dir>", cwd)
    first = argv[0] if argv else ""
    if "ipykernel" in first or not argv:
        stem, argv = "notebook", []
    else:
        script = next((a for a in argv if a.endswith(".py")), first)
        stem = os.path.splitext(os.path.basename(script))[0] or "job"
        if stem in ("-c", "-m") and len(argv) > 1:
            stem = argv[1]
    digest = hashlib.sha256(json.dumps([cwd, argv]).encode()).hexdigest()[:8]
    return folder_name(f"{stem}-{digest}")


def for_job(config: object, job_name: str | None) -> CheckpointConfig | None:
    """An executor's `checkpoint=` checked, its folder named after the job's name where the
    user gave one (not the Ray job's id: the same command must find the same folder)."""
    if config is None:
        return None
    if not isinstance(config, CheckpointConfig):
        raise ConfigError(f"checkpoint must be a raytrain_x.CheckpointConfig, got "
                          f"{type(config).__name__}")
    return config.named(job_name)


def from_env(env: dict[str, str] | None = None) -> CheckpointConfig | None:
    """The config the driver gave this worker (`CheckpointConfig.to_env`), or None."""
    raw = CHECKPOINT.read(env)
    if not raw:
        return None
    try:
        fields: dict[str, Any] = json.loads(raw)
        return CheckpointConfig(**fields)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"environment {CHECKPOINT.env}={raw!r} is not a checkpoint "
                          f"config: {exc}") from None
