"""`CheckpointConfig`: where and how often an elastic job writes durable checkpoints.

Pure data, shared by the driver (which passes it to its workers through one environment
variable) and the workers (which write and read the checkpoints).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from raytrain_x.common.errors import ConfigError
from raytrain_x.common.settings import CHECKPOINT

DEFAULT_NAME = "raytrain-x"  # the job's folder when neither the config nor the job names one


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
            Default: the job's name where one was given (`RayExecutor(name=...)`,
            `RAYTRAIN_X_JOB_NAME`), else "raytrain-x".
        every_s: seconds between checkpoints (counted from the start of the last write;
            a write still under way when the next is due makes that one wait for the next
            commit after it ends).
        keep: how many complete checkpoints to keep (older ones are deleted once a newer
            one is complete).
        write_timeout_s: how long the checkpoint's last writer waits for the other ranks'
            parts before it gives that checkpoint up (a warning; training goes on).
    """

    storage_path: str
    name: str | None = None
    every_s: float = 300.0
    keep: int = 2
    write_timeout_s: float = 600.0

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

    def named(self, job_name: str | None) -> CheckpointConfig:
        """This config with its folder's name settled (the job's name, else the default)."""
        if self.name is not None:
            return self
        return CheckpointConfig(self.storage_path, job_name or DEFAULT_NAME, self.every_s,
                                self.keep, self.write_timeout_s)

    def to_env(self) -> dict[str, str]:
        """The environment variable that gives a worker this config."""
        return {CHECKPOINT.env: json.dumps(asdict(self))}


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
