"""horovodrun's flags on `raytrain-x run`: those with a meaning on Ray do what horovodrun's
do; the others are accepted with a one-line warning that says why they do nothing, so a
horovodrun command line runs with only the launcher's name changed."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from raytrain_x.common import settings
from raytrain_x.common.errors import ConfigError

# flags -> (values they take, why they do nothing on Ray)
NO_MEANING: dict[tuple[str, ...], tuple[int, str]] = {
    ("-p", "--ssh-port"): (1, "Ray starts the workers, not SSH"),
    ("-i", "--ssh-identity-file"): (1, "Ray starts the workers, not SSH"),
    ("--disable-cache",): (0, "there is no SSH check to cache"),
    ("--network-interface", "--network-interfaces"): (
        1, "collectives listen on each worker's Ray node address"),
    ("--mpi",): (0, "raytrain-x runs on gloo (and NCCL) through Ray, not MPI"),
    ("--jsrun",): (0, "raytrain-x runs on gloo (and NCCL) through Ray, not jsrun"),
    ("--mpi-args",): (1, "there is no mpirun to pass them to"),
    ("--tcp",): (0, "an MPI transport option"),
    ("--binding-args",): (1, "an MPI process-binding option"),
    ("--mpi-threads-disable",): (0, "there is no MPI"),
    ("--num-nccl-streams",): (1, "each communicator has one NCCL stream"),
    ("--thread-affinity",): (1, "a oneCCL option"),
    ("--log-with-timestamp", "--log-without-timestamp", "--log-hide-timestamp"): (
        0, "log lines are formatted by Python's logging"),
}
# settings with a flag of Horovod's spelling that travel to the workers as their variable
WORKER_SETTINGS = (settings.STALL_WARNING_S, settings.STALL_SHUTDOWN_S,
                   settings.TIMELINE_MARK_CYCLES, settings.LOG_LEVEL)


def add_flags(run: argparse.ArgumentParser, add_flag: Any) -> None:
    """horovodrun's flags that `raytrain-x run` did not have under these names."""
    hosts = run.add_argument_group("hosts (horovodrun's)")
    hosts.add_argument("-H", "--hosts", help="host1:slots,host2:slots: the Ray nodes (IP "
                       "address, hostname, node id, or localhost) and slots to run on; an "
                       "elastic job takes them as its discovered hosts")
    hosts.add_argument("-hostfile", "--hostfile", help="a file of 'host:slots' (or 'host "
                       "slots=N') lines, as -H")
    hosts.add_argument("--slots-per-host", "--slots", dest="slots_per_host", type=int,
                       metavar="N", help="slots of a host given without them (in -H, the "
                       "hostfile or the discovery script's output)")
    more = run.add_argument_group("more of horovodrun's flags")
    more.add_argument("-cb", "--check-build", action="store_true",
                      help="show the frameworks, controllers and tensor operations this "
                      "build has, and exit")
    more.add_argument("-v", "--version", action="store_true", help="show the version and exit")
    more.add_argument("--gloo", action="store_true",
                      help="horovodrun's controller choice; raytrain-x always runs on gloo")
    more.add_argument("--gloo-timeout-seconds", dest="timeout", type=float, metavar="S",
                      help="horovodrun's name of --timeout")
    more.add_argument("--output-filename", metavar="DIR",
                      help="also write each rank's output to DIR/rank.N/stdout")
    more.add_argument("--prefix-output-with-timestamp", action="store_true",
                      help="prefix each output line with the time it was printed")
    more.add_argument("--log-level", type=str.upper, choices=settings.LOG_LEVEL.choices,
                      help=settings.LOG_LEVEL.doc)
    for setting in WORKER_SETTINGS[:-1]:
        add_flag(more, setting, _dest(setting))
    more.add_argument("--no-stall-check", dest=_dest(settings.STALL_WARNING_S),
                      action="store_const", const=0.0,
                      help="no stall warnings or shutdown (--stall-check-warning-time-seconds 0)")
    ignored = run.add_argument_group("horovodrun's flags that do nothing on Ray (a warning "
                                     "says why)")
    for flags, (nargs, why) in NO_MEANING.items():
        ignored.add_argument(*flags, dest=f"ignored_{flags[-1].lstrip('-')}",
                             **({"metavar": "X"} if nargs else {"action": "store_true"}),
                             help=why)


def _dest(setting: settings.Setting) -> str:
    return "hv_" + setting.flag.lstrip("-").replace("-", "_")


def warn_ignored(args: argparse.Namespace) -> None:
    """One line on stderr per flag given that does nothing on Ray."""
    for flags, (_, why) in NO_MEANING.items():
        if getattr(args, f"ignored_{flags[-1].lstrip('-')}", None):
            sys.stderr.write(f"raytrain-x: warning: {flags[-1]} does nothing here: {why}\n")


def worker_env(args: argparse.Namespace) -> dict[str, str]:
    """The variables of the horovodrun flags given, for every worker."""
    env = {}
    for setting in WORKER_SETTINGS:
        value = getattr(args, "log_level" if setting is settings.LOG_LEVEL else _dest(setting),
                        None)
        if value is not None:
            env[setting.env] = str(int(value) if isinstance(value, bool) else value)
    return env


def host_list(args: argparse.Namespace) -> dict[str, int] | None:
    """The hosts of -H or -hostfile (None: neither given)."""
    from raytrain_x.ray.elastic.discovery import parse_host_slots, parse_hosts

    if args.hosts and args.hostfile:
        raise ConfigError("give -H/--hosts or -hostfile, not both")
    if args.hosts:
        return parse_hosts(args.hosts, args.slots_per_host)
    if args.hostfile:
        try:
            with open(args.hostfile) as f:
                text = f.read()
        except OSError as exc:
            raise ConfigError(f"-hostfile {args.hostfile!r} cannot be read: {exc}") from None
        return parse_host_slots(text, f"hostfile {args.hostfile!r}",
                                args.slots_per_host or 1)
    return None


def check_build() -> str:
    """horovodrun --check-build's table, for this build."""
    import importlib.util

    from raytrain_x import __version__
    from raytrain_x.core import basics

    def box(yes: bool) -> str:
        return "[X]" if yes else "[ ]"

    def has(module: str) -> bool:
        return importlib.util.find_spec(module) is not None

    return "\n".join([
        f"raytrain-x v{__version__}:", "", "Available Frameworks:",
        f"    {box(has('tensorflow'))} TensorFlow", f"    {box(has('torch'))} PyTorch",
        f"    {box(False)} MXNet", "", "Available Controllers:", f"    {box(False)} MPI",
        f"    {box(True)} Gloo", "", "Available Tensor Operations:",
        f"    {box(basics.nccl_built())} NCCL", f"    {box(False)} DDL", f"    {box(False)} CCL",
        f"    {box(False)} MPI", f"    {box(True)} Gloo", ""])


def output_writer(folder: str | None) -> Any:
    """`write(rank, line)` into `folder`/rank.N/stdout (Horovod's layout); None: no
    folder given."""
    if not folder:
        return None
    files: dict[int, Any] = {}

    def write(rank: int, line: str) -> None:
        if rank not in files:
            os.makedirs(os.path.join(folder, f"rank.{rank}"), exist_ok=True)
            files[rank] = open(os.path.join(folder, f"rank.{rank}", "stdout"), "a")  # noqa: SIM115
        files[rank].write(line + "\n")
        files[rank].flush()

    return write
