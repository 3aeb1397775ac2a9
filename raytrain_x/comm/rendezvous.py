"""Where a worker learns its place in the world: ranks, sizes and the store to meet at."""

from __future__ import annotations

import ipaddress
import os
import secrets
import stat
import tempfile
from dataclasses import dataclass, field
from typing import Any

from raytrain_x.common import settings
from raytrain_x.common.errors import ConfigError

DEFAULT_TIMEOUT_S = settings.TIMEOUT_S.default


@dataclass
class Rendezvous:
    """One rendezvous round's description of this worker's place in the world.

    Attributes:
        rank, size: global rank and world size.
        local_rank, local_size: rank and count of workers on this host.
        cross_rank, cross_size: index of this host and number of hosts.
        store: the store all workers meet at (an `ActorStore`, a `TcpStoreAddress` or a
            backend's own store; None for size 1).
        timeout_s: collective and store timeout; a dead or stuck peer fails within it.
        round: rendezvous round (elastic resets start a new one).
        hosts: optional host id of every rank (rank order), for hierarchical groups.
        hosts_version: the elastic driver's host-set version this round was formed at.
        restore_from_storage: the elastic driver found no worker holding the job's latest
            committed state: the round restores a durable checkpoint.
        restore_checkpoint: the checkpoint the driver named for that restore,
            `[generation, commit]` (None: the latest).
        elastic: an elastic driver formed this round, and decides every round's restore;
            in a fixed world the job's start is the only restore.
        address: the IP address this worker's collectives listen on (its Ray node's
            address); empty: the backend's default (gloo: `GLOO_SOCKET_IFNAME`, else what
            the hostname resolves to, which is loopback on many machines).
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    store: Any = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    round: int = 0
    hosts: list[str] = field(default_factory=list)
    hosts_version: int = 0
    address: str = ""
    restore_from_storage: bool = False
    restore_checkpoint: list[int] | None = None
    elastic: bool = False

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ConfigError(f"rank {self.rank} is not in a world of size {self.size}")
        if self.local_size < 1 or not 0 <= self.local_rank < self.local_size:
            raise ConfigError(f"local_rank {self.local_rank} not in local_size {self.local_size}")
        if self.cross_size < 1 or not 0 <= self.cross_rank < self.cross_size:
            raise ConfigError(f"cross_rank {self.cross_rank} not in cross_size {self.cross_size}")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.size > 1 and self.store is None:
            raise ConfigError("a world larger than 1 needs a store; start workers with "
                              "RayExecutor or raytrain-x run, or set RAYTRAIN_X_STORE_ADDR/PORT")


@dataclass
class TcpStoreAddress:
    """A TCP key-value store that rank 0 serves and the others reach (a script launched by
    `raytrain-x run`): `raytrain_x.comm.job_store`, which answers only processes that prove
    the job's secret. The backend opens it once, on first use, in its own store type.

    Attributes:
        secret: the job's secret (`RAYTRAIN_X_STORE_SECRET`).
        opened: the backend's open store, shared by every group of this process.
    """

    host: str
    port: int
    world_size: int
    is_server: bool
    timeout_s: float
    secret: str = field(default="", repr=False)
    opened: Any = field(default=None, repr=False, compare=False)


def loopback_secret() -> str:
    """This user's secret for jobs on one machine whose store is on loopback and that were
    given none: made once, in a file only this user can read
    (`<tmp>/raytrain-x-<uid>/store-secret`), so any process of this user joins and no other
    local user's process can (a fixed secret let every local user read and write the
    keys)."""
    folder = os.path.join(tempfile.gettempdir(), f"raytrain-x-{os.getuid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() \
            or stat.S_IMODE(info.st_mode) & 0o077:
        raise ConfigError(f"{folder} is not this user's private folder (another user made "
                          f"it, or others may read it); remove it, or give every process "
                          f"the same {settings.STORE_SECRET.env}")
    path = os.path.join(folder, "store-secret")
    if not os.path.exists(path):
        fd, tmp = tempfile.mkstemp(dir=folder)  # 0600
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)  # whole or not at all: the first process's secret wins
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    with open(path) as f:
        return f.read().strip()


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def rendezvous_from_env(env: Any, round_id: int = 1) -> Rendezvous:
    """Builds round `round_id`'s Rendezvous from the launcher's variables
    (`settings.LAUNCHER`) with a TCP store (rank 0 hosts it); a world of one without
    them."""

    size = settings.SIZE.read(env)
    rank = settings.RANK.read(env)
    timeout_s = settings.TIMEOUT_S.read(env)
    store = None
    if size > 1:
        addr = settings.STORE_ADDR.read(env)
        port = settings.STORE_PORT.read(env)
        if not addr or not port:
            raise ConfigError(f"{settings.SIZE.env}={size} but no {settings.STORE_ADDR.env}/"
                              "PORT; launch with raytrain-x run or RayExecutor")
        secret = settings.STORE_SECRET.read(env)
        if not secret and _is_loopback(addr):
            # One machine, a store on loopback only: nothing off the machine reaches it,
            # and this user's own secret keeps other local users out
            secret = loopback_secret()
        if not secret:
            raise ConfigError(f"{settings.SIZE.env}={size} but no {settings.STORE_SECRET.env}: "
                              "the job's store answers only processes that know the job's "
                              "secret; launch with raytrain-x run, or give every process the "
                              "same random value (python -c 'import secrets; "
                              "print(secrets.token_hex(32))'); a job on one machine may "
                              f"instead use {settings.STORE_ADDR.env}=127.0.0.1")
        store = TcpStoreAddress(addr, port, size, rank == 0, timeout_s, secret)
    return Rendezvous(
        rank=rank,
        size=size,
        round=round_id,
        local_rank=_or(settings.LOCAL_RANK.read(env), rank),
        local_size=_or(settings.LOCAL_SIZE.read(env), size),
        cross_rank=settings.CROSS_RANK.read(env),
        cross_size=settings.CROSS_SIZE.read(env),
        store=store,
        timeout_s=timeout_s,
    )
