"""Horovod's build and runtime queries (`gloo_built`, `nccl_built`, `mpi_enabled`, ...) and
the timeline switches, answered for raytrain-x: gloo (torch's) is always the transport,
NCCL where torch has it, never MPI, oneCCL or DDL."""

from __future__ import annotations

import functools

from raytrain_x.comm.backend import built_libraries
from raytrain_x.core.runtime import engine


@functools.cache
def _built() -> dict[str, bool]:
    return built_libraries()


def gloo_built() -> bool:
    """True where torch has gloo, which raytrain-x uses between every pair of hosts."""
    return _built()["gloo"]


def gloo_enabled() -> bool:
    """True: every raytrain-x job runs on gloo (and NCCL for CUDA tensors)."""
    return _built()["gloo"]


def nccl_built() -> bool:
    """True where torch has NCCL, which carries CUDA tensors between GPUs."""
    return _built()["nccl"]


def cuda_built() -> bool:
    """True where torch was built with CUDA."""
    return _built()["cuda"]


def mpi_built() -> bool:
    """False: raytrain-x never uses MPI (Ray starts the processes, gloo connects them)."""
    return False


def mpi_enabled() -> bool:
    """False: raytrain-x never uses MPI."""
    return False


def mpi_threads_supported() -> bool:
    """False: raytrain-x never uses MPI."""
    return False


def ccl_built() -> bool:
    """False: raytrain-x does not use oneCCL."""
    return False


def ddl_built() -> bool:
    """False: raytrain-x does not use IBM DDL."""
    return False


def rocm_built() -> bool:
    """False: raytrain-x is not built for ROCm."""
    return False


def is_homogeneous() -> bool:
    """True when every host runs the same number of workers."""
    return engine().groups.homogeneous()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Starts writing rank 0's Chrome trace to `file_path` (or moves it there) while the job
    runs; `mark_cycles` adds a CYCLE_START mark per engine cycle that ran a collective.

    Args:
        file_path: where rank 0 writes the Chrome trace (a JSON file).
        mark_cycles: add a `CYCLE_START` mark for each engine cycle that ran a collective.
    """
    engine().start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Closes the trace started by `start_timeline` (or `RAYTRAIN_X_TIMELINE`)."""
    engine().stop_timeline()
