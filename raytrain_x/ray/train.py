"""Ray Train v2: a raytrain-x world on Ray Train's worker group.

`RaytrainXTrainer` is a `DataParallelTrainer` whose backend forms the raytrain-x world on
the workers Ray Train placed, so `import raytrain_x.torch as rx; rx.init()` (or the
TensorFlow face) works inside `train_loop_per_worker` beside everything Ray Train gives its
workers: `ray.train.report` with checkpoints, `get_checkpoint`, `get_context`, Ray Data
shards, `FailureConfig` restarts, Tune. `HorovodTrainer`/`HorovodConfig` take the names and
arguments of Ray Train v1's, for scripts that used them.

The world's ranks are Ray Train's (`rx.rank() == ray.train.get_context().get_world_rank()`,
local ranks likewise; a node is a cross rank), the rendezvous goes through a store actor
made for each worker group, and knobs and autotune come from the config as they do for
`RayExecutor`. A restart after a failure is a new worker group: a new store, a new world.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.train.backend import Backend, BackendConfig
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from raytrain_x.comm.store import ActorStore
from raytrain_x.comm.store_actor import StoreActor, control_concurrency
from raytrain_x.common import training
from raytrain_x.common.autotune_config import AutotuneConfig
from raytrain_x.common.errors import ConfigError
from raytrain_x.common.knobs import Knobs, load_knobs, read_training_settings
from raytrain_x.common.settings import JOB_NAME, TIMEOUT_S
from raytrain_x.ray import metrics
from raytrain_x.ray.autotune_actor import fixed_knob_env, knob_env, start_autotune
from raytrain_x.ray.elastic_trainer import check_elastic_scaling, fit_elastic
from raytrain_x.ray.placement import stable_node_strategy
from raytrain_x.ray.worker import install_world

FRAMEWORKS = {"torch": "torch", "tensorflow": "tensorflow"}  # name -> module it needs
_LEAVE_TIMEOUT_S = 10.0  # how long a graceful shutdown waits for the workers' engines


__all__ = ["HorovodConfig", "HorovodTrainer", "RaytrainXBackend", "RaytrainXConfig",
           "RaytrainXTrainer"]


@dataclass
class RaytrainXConfig(BackendConfig):
    """How the raytrain-x world on a Ray Train worker group is set up.

    Attributes:
        framework: "torch" or "tensorflow" (the face the training loop imports), checked to
            be installed before any worker starts; None: either (checked: one is).
        knobs: communication knobs for every worker, all held fixed (default: the
            `RAYTRAIN_X_*`/`HOROVOD_*` environment and the config file, as elsewhere).
        autotune: an `AutotuneConfig` (or True for the defaults): tune the knobs while
            training; the controller runs as a Ray actor, rank 0 reports each sample to it
            and writes the log (`log_file`). Each worker group (a restart too) searches
            afresh.
        timeout_s: rendezvous and collective timeout: a lost peer fails the others within it,
            and Ray Train's `FailureConfig` decides whether the run restarts.
        config_file: a YAML/JSON file (read here, on the driver) whose knobs every worker
            holds fixed and whose training settings (`zero_stage`, `micro_batch_size`,
            `gradient_accumulation_steps`) every worker gets: `autotune_experiments`'
            `best_config.json` is one. `DistributedOptimizer` takes its `zero_stage`, the
            loop reads the rest with `raytrain_x.training_settings()`.
        policies: an elastic run's driver policies (`raytrain_x.ray.DriverPolicy`s, such
            as `SlowWorkers()`): they decide which workers leave the run at a commit.
    """

    framework: str | None = None
    knobs: Knobs | None = None
    autotune: AutotuneConfig | bool | None = None
    timeout_s: float = TIMEOUT_S.default
    config_file: str | None = None
    policies: tuple = ()

    def __post_init__(self) -> None:
        if self.framework is not None and self.framework not in FRAMEWORKS:
            raise ConfigError(f"framework must be one of {sorted(FRAMEWORKS)} (or None), got "
                              f"{self.framework!r}")
        wanted = [self.framework] if self.framework else list(FRAMEWORKS)
        if not any(importlib.util.find_spec(FRAMEWORKS[f]) for f in wanted):
            raise ConfigError(
                f"framework {' or '.join(wanted)} is not installed here: install raytrain-x "
                f"with the {wanted[0]} extra (pip install 'raytrain-x[{wanted[0]}]')")
        if self.knobs is not None and not isinstance(self.knobs, Knobs):
            raise ConfigError(f"knobs must be a raytrain_x.Knobs, got {type(self.knobs).__name__}")
        if self.autotune is True:
            self.autotune = AutotuneConfig()
        elif self.autotune is False:
            self.autotune = None
        if self.autotune is not None and not isinstance(self.autotune, AutotuneConfig):
            raise ConfigError("autotune must be an AutotuneConfig (or True for the defaults), "
                              f"got {type(self.autotune).__name__}")
        if self.autotune is not None and self.knobs is not None:
            raise ConfigError(
                "knobs fixes every knob, so autotune has nothing to tune: give the starting "
                "values as AutotuneConfig(initial_knobs=...) instead, or drop autotune")
        self._file_env: dict[str, str] = {}
        if self.config_file is not None:
            if self.knobs is not None:
                raise ConfigError("give the knobs either as knobs= or in config_file, not both")
            file_knobs, fixed = load_knobs(config_file=self.config_file, env={})
            self._file_env = {**fixed_knob_env(file_knobs, fixed),
                              **training.to_env(read_training_settings(self.config_file))}
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be a positive number of seconds, got "
                              f"{self.timeout_s}")

    @property
    def backend_cls(self) -> type[Backend]:
        return RaytrainXBackend

    def to_dict(self) -> dict[str, Any]:
        return {"framework": self.framework, "timeout_s": self.timeout_s,
                "knobs": self.knobs.to_dict() if self.knobs else None,
                "autotune": self.autotune is not None}


@dataclass
class HorovodConfig(RaytrainXConfig):
    """Ray Train v1's `HorovodConfig` arguments, for scripts that used them.

    `timeout_s` is the rendezvous and collective timeout; `verbose`, `key` and
    `placement_group_timeout_s` are taken and not needed (the world meets through a Ray
    actor, and Ray Train places the workers); `nics` and the ssh arguments are refused:
    Ray places and connects the workers itself.

    Attributes:
        nics: refused: Ray connects the workers.
        verbose: accepted, not needed.
        key: accepted, not needed (the world meets through a Ray actor).
        ssh_port: refused: Ray starts the workers.
        ssh_identity_file: refused: Ray starts the workers.
        ssh_str: refused: Ray starts the workers.
        placement_group_timeout_s: accepted, not needed (Ray Train places the workers).
    """

    nics: set[str] | None = None
    verbose: int = 1
    key: str | None = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    ssh_str: str | None = None
    placement_group_timeout_s: int = 100

    def __post_init__(self) -> None:
        given = [n for n in ("nics", "ssh_port", "ssh_identity_file", "ssh_str")
                 if getattr(self, n) is not None]
        if given:
            raise ConfigError(f"HorovodConfig does not take {given} here: Ray places and "
                              "connects the workers itself; drop them")
        super().__post_init__()


class RaytrainXBackend(Backend):
    """Forms the raytrain-x world on a Ray Train worker group (one instance per process,
    as Ray Train's backends are)."""

    share_cuda_visible_devices = True  # local rank k drives the node's k-th GPU

    def __init__(self) -> None:
        self._store: Any = None
        self._autotune_actor: Any = None

    def on_start(self, worker_group: Any, backend_config: RaytrainXConfig) -> None:
        places = worker_group.execute(_place)
        for index, place in enumerate(places):
            if place["rank"] != index:
                raise ConfigError(f"Ray Train gave worker {index} world rank {place['rank']}: "
                                  "the worker group is not in rank order")
        env = {TIMEOUT_S.env: str(backend_config.timeout_s)}
        if backend_config.knobs is not None:
            env.update(knob_env(backend_config.knobs))
        env.update(backend_config._file_env)
        if backend_config.autotune is not None:
            extra, self._autotune_actor = start_autotune(backend_config.autotune,
                                                         backend_config.knobs)
            env.update(extra)
        self._store = StoreActor.options(
            scheduling_strategy=stable_node_strategy(),
            max_concurrency=control_concurrency(len(places))).remote()
        hosts = [p["host"] for p in places]
        cross_size = max(p["node_rank"] for p in places) + 1
        torch_group = backend_config.framework in (None, "torch") and \
            importlib.util.find_spec("torch") is not None
        ray.get([
            worker_group.execute_single_async(
                rank, _join,
                {"rank": rank, "size": len(places), "local_rank": p["local_rank"],
                 "local_size": p["local_size"], "cross_rank": p["node_rank"],
                 "cross_size": cross_size, "timeout_s": backend_config.timeout_s,
                 "hosts": hosts},
                self._store, env, self._autotune_actor if rank == 0 else None, torch_group)
            for rank, p in enumerate(places)])

    def on_shutdown(self, worker_group: Any, backend_config: RaytrainXConfig) -> None:
        try:
            refs = worker_group.execute_async(_leave)
            ray.wait(refs, num_returns=len(refs), timeout=_LEAVE_TIMEOUT_S)
        finally:
            for actor in (self._store, self._autotune_actor):
                if actor is not None:
                    ray.kill(actor, no_restart=True)
            self._store = self._autotune_actor = None


# ------------------------------------------------------------------------ in the workers
def _place() -> dict[str, Any]:
    context = ray.train.get_context()
    return {"rank": context.get_world_rank(), "local_rank": context.get_local_rank(),
            "local_size": context.get_local_world_size(),
            "node_rank": context.get_node_rank(),
            "host": ray.util.get_node_ip_address()}  # Ray Train's local ranks go by node IP


def _join(rdv: dict[str, Any], store: Any, env: dict[str, str], autotune_actor: Any,
          torch_group: bool) -> None:
    inits = [0]

    def next_round() -> int:  # every init() after a shutdown() meets in a fresh key space
        inits[0] += 1
        return inits[0]

    install_world(rdv, store, env, autotune_actor, next_round)
    if torch_group:  # a TorchTrainer loop's `prepare_model` (DDP) needs torch's default group
        _torch_face("default_group").init_default_group(
            ActorStore(store, rdv["timeout_s"]), rdv["rank"], rdv["size"], rdv["timeout_s"],
            rdv["hosts"][0])
    # the run's name is the `job` tag of its workers' metrics, unless one was set
    job = os.environ.get(JOB_NAME.env) or ray.train.get_context().get_experiment_name()
    metrics.export_this_process(metrics.rank_status, job,
                                ray.get_runtime_context().get_node_id()[:8])


def _leave() -> None:
    from raytrain_x.core import runtime

    runtime.shutdown()
    if "torch" in sys.modules:
        _torch_face("default_group").destroy_default_group()


def _torch_face(module: str) -> Any:
    """A module of the torch face, in a worker. Looked up by name: the driver side never
    imports a framework face (docs/architecture.md), and these calls run in the workers,
    which import torch anyway."""
    return importlib.import_module(f"raytrain_x.torch.{module}")


# ------------------------------------------------------------------------ trainers
class RaytrainXTrainer(DataParallelTrainer):
    """A Ray Train v2 trainer whose workers form a raytrain-x world.

    Args:
        train_loop_per_worker: the training function; it calls `rx.init()` (torch or
            TensorFlow face) and may use every `ray.train` worker API.
        train_loop_config: passed to `train_loop_per_worker` when it takes an argument.
        raytrain_x_config: a `RaytrainXConfig` (knobs, autotune, timeout, framework).
        scaling_config: Ray Train's `ScalingConfig`: `num_workers=N` (>= 1) runs on Ray
            Train's controller, which restarts the group on any change;
            `num_workers=(min, max)` runs elastically on raytrain-x's driver: survivors keep
            their state in memory, the world grows to `max` as capacity comes
            (docs/ray_train.md, "Elastic").
        run_config: Ray Train's `RunConfig`.
        datasets: Ray Data datasets, sharded over the workers as Ray Train does (elastic:
            re-divided among the current world at every step, each row once per epoch).
        dataset_config: Ray Train's `DataConfig`.
        validation_config: Ray Train's, unchanged.
    """

    _config_arg = "raytrain_x_config"

    def __init__(self, train_loop_per_worker: Callable[..., Any], *,
                 train_loop_config: dict | None = None,
                 raytrain_x_config: RaytrainXConfig | None = None,
                 scaling_config: Any = None, run_config: Any = None,
                 datasets: dict[str, Any] | None = None, dataset_config: Any = None,
                 validation_config: Any = None, **deprecated: Any) -> None:
        config = raytrain_x_config if raytrain_x_config is not None else RaytrainXConfig()
        if not isinstance(config, RaytrainXConfig):
            raise ConfigError(f"{self._config_arg} must be a RaytrainXConfig, got "
                              f"{type(config).__name__}")
        if not callable(train_loop_per_worker):
            raise ConfigError("train_loop_per_worker must be a function, got "
                              f"{type(train_loop_per_worker).__name__}")
        workers = scaling_config.num_workers if scaling_config is not None else None
        if isinstance(workers, tuple):
            check_elastic_scaling(scaling_config)
        elif workers is not None and workers < 1:
            raise ConfigError(f"ScalingConfig(num_workers={workers}): a raytrain-x world "
                              "needs num_workers >= 1")
        super().__init__(train_loop_per_worker, train_loop_config=train_loop_config,
                         backend_config=config, scaling_config=scaling_config,
                         run_config=run_config, datasets=datasets,
                         dataset_config=dataset_config, validation_config=validation_config,
                         **deprecated)

    def fit(self) -> Any:
        """Runs the training and returns Ray Train's `Result`. With
        `ScalingConfig(num_workers=(min, max))` the loop runs on raytrain-x's elastic driver
        (`raytrain_x.ray.elastic_trainer`: the world changes in memory, no restart); with a
        fixed `num_workers`, on Ray Train's controller.

        Raises:
            TrainingFailedError: the run failed (Ray Train's `WorkerGroupError` or
                `ControllerError`), with the cause chained.
        """
        if isinstance(self.scaling_config.num_workers, tuple):
            return fit_elastic(self)
        return super().fit()


class HorovodTrainer(RaytrainXTrainer):
    """Ray Train v1's `HorovodTrainer`, by name and arguments (`horovod_config`), on Ray
    Train v2 and raytrain-x. `metadata` and `resume_from_checkpoint` are refused as Ray
    Train v2 refuses them for every trainer (use `get_checkpoint()` and `RunConfig`).

    Args:
        train_loop_per_worker: the training function; it calls `rx.init()` and may use every
            `ray.train` worker API.
        train_loop_config: passed to `train_loop_per_worker` when it takes an argument.
        horovod_config: a `HorovodConfig` (default: `HorovodConfig()`).
        scaling_config: Ray Train's `ScalingConfig`.
        dataset_config: Ray Train's `DataConfig`.
        run_config: Ray Train's `RunConfig`.
        datasets: Ray Data datasets, sharded over the workers.
        metadata: refused: Ray Train v2 has no trainer metadata.
        resume_from_checkpoint: refused: restore inside the loop with `ray.train.get_checkpoint()`.
    """

    _config_arg = "horovod_config"

    def __init__(self, train_loop_per_worker: Callable[..., Any], *,
                 train_loop_config: dict | None = None,
                 horovod_config: HorovodConfig | None = None,
                 scaling_config: Any = None, dataset_config: Any = None,
                 run_config: Any = None, datasets: dict[str, Any] | None = None,
                 metadata: dict | None = None, resume_from_checkpoint: Any = None) -> None:
        if metadata is not None or resume_from_checkpoint is not None:
            raise ConfigError("metadata and resume_from_checkpoint are gone in Ray Train v2: "
                              "restore inside the loop with ray.train.get_checkpoint(), and "
                              "resume a run by giving RunConfig the same name and storage_path")
        super().__init__(train_loop_per_worker, train_loop_config=train_loop_config,
                         raytrain_x_config=horovod_config or HorovodConfig(),
                         scaling_config=scaling_config, run_config=run_config,
                         datasets=datasets, dataset_config=dataset_config)
