"""`RayExecutor`: Ray actors that form raytrain-x worlds (horovod.ray's API)."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from raytrain_x.common.autotune_config import AutotuneConfig
from raytrain_x.common.checkpoint_config import (
    CheckpointConfig,
    driver_dir,
    entrypoint_name,
    for_job,
)
from raytrain_x.common.errors import ConfigError
from raytrain_x.common.knobs import Knobs
from raytrain_x.common.settings import (
    CHECKPOINT_DRIVER,
    CHECKPOINT_NAME,
    CHECKPOINT_RUN,
    DRIVER_DIR,
    JOB_NAME,
    METRICS,
    METRICS_INTERVAL_S,
    START_TIMEOUT_S,
    TIMEOUT_S,
    check_seconds,
)
from raytrain_x.ray import metrics
from raytrain_x.ray.autotune_actor import knob_env, start_autotune
from raytrain_x.ray.connect import (
    Settings,
    apply_verbose,
    ensure_ray,
    horovod_shape,
    job_name,
    make_settings,
)
from raytrain_x.ray.elastic import ElasticJob, ElasticSettings, run_job
from raytrain_x.ray.elastic.discovery import ScriptDiscovery, StaticDiscovery, parse_hosts
from raytrain_x.ray.elastic.policies import DriverPolicy
from raytrain_x.ray.elastic.settings import EVERY_FREE_SLOT
from raytrain_x.ray.metrics import DriverMetrics
from raytrain_x.ray.placement import Slot, validate_shape
from raytrain_x.ray.ray_logger import Relay
from raytrain_x.ray.static_job import StaticJob, StaticShape


class RayExecutor:
    """Starts one Ray actor per worker and runs functions on all of them.

    A facade, as Horovod's: the arguments are checked here, once; a fixed world runs as a
    `StaticJob` (`raytrain_x/ray/static_job.py`), an elastic one as an `ElasticJob`
    (`raytrain_x/ray/elastic/`).

    Args:
        settings: from `RayExecutor.create_settings`.
        num_workers: workers, packed onto as few nodes as fit (PACK placement).
        num_hosts: alternatively, hosts to spread over (STRICT_SPREAD) with
            `num_workers_per_host` workers each.
        num_workers_per_host: workers per host with `num_hosts`.
        cpus_per_worker: CPUs reserved per worker.
        use_gpu: reserve GPUs; CUDA_VISIBLE_DEVICES is shared by the workers of a node.
        gpus_per_worker: GPUs per worker (default 1 with `use_gpu`).
        use_current_placement_group: run inside the caller's placement group (Tune trials).
        min_workers: elastic: the fewest workers the job trains with; setting it (or
            `max_workers`) makes the executor elastic.
        max_workers: elastic: the most workers the job grows to; None (with `min_workers`)
            takes every free slot the cluster has, as Horovod's `max_np=None` does (the
            autoscaler is then asked for `min_workers` only).
        reset_limit: elastic: more resets than this fail the job (`ResetLimitExceeded`).
        max_failures: elastic: more failures than this fail the job
            (`FailureLimitExceeded`), counted as Ray Train's `FailureConfig(max_failures)`
            counts them: the workers lost before one reset are one failure, a drained
            node's are none; -1 or None: no limit.
        cooldown_range: elastic: `(lo, hi)` seconds a failed host stays blacklisted, doubling
            per failure from `lo` up to `hi`; without it a failed host stays out.
        elastic_timeout: elastic: how long the job waits below `min_workers` before it
            fails with `ElasticTimeout`.
        start_timeout_s: elastic: how long a new worker may take to start (process,
            imports, runtime_env, an image pull) before it is given up on; a worker that is
            slow but placeable is waited for, one that cannot be placed is given up at once.
        knobs: communication knobs for every worker, all held fixed (defaults: env and
            config file).
        autotune: an `AutotuneConfig` (or True): tune the free knobs while training; the
            controller runs as a Ray actor, rank 0 reports each sample to it.
        resources_per_worker: extra Ray resources each worker reserves.
        hosts: horovodrun's `-H`: `"host1:2,host2:2"` (or a dict): the Ray nodes (by IP
            address, hostname, node id, or `localhost` for this one) and slots the job
            runs on; a fixed job fills them in order, an elastic one takes them as its
            discovered hosts.
        slots_per_host: horovodrun's `--slots`: the slots of a host named without them (in
            `hosts` or a discovery script's output).
        host_discovery_script: elastic: an executable printing `host:slots` lines (default:
            Ray's alive nodes and their free resources).
        name: the job's name in its metrics (their `job` tag, docs/metrics.md); default:
            `RAYTRAIN_X_JOB_NAME`, else the Ray job's id and this executor's number in it.
        checkpoint: durable checkpoints of the workers' `TorchState` (`CheckpointConfig`):
            restored from when no worker holds the state, and by the same command run again.
            A config without a name takes the job's folder by one rule, here and in a
            `TorchState(checkpoint=...)` inside the job: `name`, else
            `RAYTRAIN_X_JOB_NAME`, else the Tune trial's name, else the driver's command
            (`entrypoint_name`). A local path is made absolute here, and the path is
            probed (written, read back, deleted) when the executor starts.
        override_discovery: Horovod's; taken, the discovery is Ray's unless
            `host_discovery_script` is given.
        policies: elastic: driver policies that decide which workers leave the job
            (`DriverPolicy`s), such as `SlowWorkers()`: a worker whose steps hold the
            others back leaves at its next commit (docs/elastic.md).
        cpus_per_slot: Horovod's older name of `cpus_per_worker` (give one or the other).
        gpus_per_slot: Horovod's older name of `gpus_per_worker`.

    With `min_workers`/`max_workers` the executor is elastic: `run` keeps the job going
    while workers fail or hosts come and go (see docs/elastic.md).
    """

    @staticmethod
    def create_settings(timeout_s: float = TIMEOUT_S.default,
                        placement_group_timeout_s: float = 100.0, verbose: Any = None,
                        **horovod_ssh_and_nics: Any) -> Settings:
        """Executor settings, with Horovod's arguments: `timeout_s`, `placement_group_timeout_s`,
        `verbose` (1: the job's progress at INFO, 2: DEBUG); `ssh_identity_file`, `ssh_str`
        and `nics` are taken with a warning (Ray places and connects the workers)."""
        return make_settings(timeout_s, placement_group_timeout_s, verbose,
                             **horovod_ssh_and_nics)

    def __init__(
        self,
        settings: Settings | None = None,
        num_workers: int | None = None,
        num_hosts: int | None = None,
        num_workers_per_host: int | None = 1,
        cpus_per_worker: float | None = None,
        use_gpu: bool = False,
        gpus_per_worker: float | None = None,
        use_current_placement_group: bool = True,
        min_workers: int | None = None,
        max_workers: int | None = None,
        reset_limit: int | None = None,
        cooldown_range: tuple[float, float] | None = None,
        elastic_timeout: float = 600,
        start_timeout_s: float | None = None,
        knobs: Knobs | None = None,
        autotune: Any = None,
        resources_per_worker: dict[str, float] | None = None,
        host_discovery_script: str | None = None,
        name: str | None = None,
        checkpoint: CheckpointConfig | None = None,
        override_discovery: bool = True,
        cpus_per_slot: float | None = None,
        gpus_per_slot: float | None = None,
        hosts: str | Mapping[str, int] | None = None,
        slots_per_host: int | None = None,
        max_failures: int | None = None,
        policies: Sequence[Any] = (),
    ) -> None:
        num_workers_per_host, cpus_per_worker, gpus_per_worker = horovod_shape(
            num_workers, min_workers, num_workers_per_host, cpus_per_worker, gpus_per_worker,
            cpus_per_slot, gpus_per_slot)
        if settings is not None and not isinstance(settings, Settings):
            raise ConfigError("settings must come from RayExecutor.create_settings(...), got "
                              f"{type(settings).__name__}")
        elastic = min_workers is not None or max_workers is not None
        if elastic:
            num_workers = num_workers if num_workers is not None else (min_workers or 1)
        validate_shape(num_workers, num_hosts, num_workers_per_host, cpus_per_worker,
                       gpus_per_worker, use_gpu)
        if min_workers is not None and (min_workers < 1 or (max_workers is not None
                                                            and max_workers < min_workers)):
            raise ConfigError(f"need 1 <= min_workers <= max_workers, got {min_workers}, "
                              f"{max_workers}")
        if max_failures is not None and not (isinstance(max_failures, int)
                                             and max_failures >= -1):
            raise ConfigError(f"max_failures must be an int >= -1 (-1: no limit), got "
                              f"{max_failures!r}")
        if reset_limit is not None and reset_limit < 0:
            raise ConfigError(f"reset_limit must be >= 0, got {reset_limit}")
        policies = tuple(policies or ())
        if policies and not elastic:
            raise ConfigError("policies= decide which workers leave an elastic job; give "
                              "min_workers/max_workers too")
        for policy in policies:
            if not isinstance(policy, DriverPolicy):
                raise ConfigError(f"each of policies= needs a decide(job) method (a "
                                  f"raytrain_x.ray.DriverPolicy such as SlowWorkers()), got "
                                  f"{policy!r}")
        if cooldown_range is not None and (
                len(cooldown_range) != 2 or
                not 0 < check_seconds("cooldown_range", cooldown_range[0])
                <= check_seconds("cooldown_range", cooldown_range[1])):
            raise ConfigError(f"cooldown_range must be (lo, hi) with 0 < lo <= hi, got "
                              f"{cooldown_range}")
        elastic_timeout = check_seconds("elastic_timeout", elastic_timeout)
        start_timeout_s = check_seconds("start_timeout_s", START_TIMEOUT_S.read()
                                        if start_timeout_s is None else start_timeout_s)
        if knobs is not None and not isinstance(knobs, Knobs):
            raise ConfigError(f"knobs must be a raytrain_x.Knobs, got {type(knobs).__name__}")
        if autotune is True:
            autotune = AutotuneConfig()
        if autotune is not None and not isinstance(autotune, AutotuneConfig):
            raise ConfigError("autotune must be an AutotuneConfig (or True for the defaults), "
                              f"got {type(autotune).__name__}")
        self.settings = settings or Settings()
        self.num_workers = num_workers
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker if gpus_per_worker is not None
                                else (1 if use_gpu else 0))
        self.use_current_placement_group = use_current_placement_group
        self.min_workers, self.max_workers = min_workers, max_workers
        self.reset_limit, self.cooldown_range = reset_limit, cooldown_range
        self.max_failures = None if max_failures == -1 else max_failures
        self.policies = policies
        self.elastic_timeout = elastic_timeout
        self.start_timeout_s = start_timeout_s
        # how often an elastic job looks for capacity to grow into (the elastic trainer sets
        # it from ScalingConfig(elastic_resize_monitor_interval_s))
        self.discovery_interval_s = ElasticSettings.discovery_interval_s
        self.knobs = knobs
        self.autotune = autotune
        self.elastic = elastic
        if elastic:
            self.min_workers = min_workers or 1
            self.max_workers = max_workers if max_workers is not None else EVERY_FREE_SLOT
        if resources_per_worker is not None and any(
                not isinstance(v, (int, float)) or v < 0 for v in resources_per_worker.values()):
            raise ConfigError(f"resources_per_worker needs non-negative numbers, got "
                              f"{resources_per_worker}")
        self.resources_per_worker = dict(resources_per_worker or {})
        self.host_discovery_script = host_discovery_script
        if host_discovery_script is not None:
            ScriptDiscovery(host_discovery_script)  # validates it now, not mid-job
        if slots_per_host is not None and slots_per_host < 1:
            raise ConfigError(f"slots_per_host must be >= 1, got {slots_per_host}")
        self.slots_per_host = slots_per_host
        self.host_discovery: Any = None  # a HostDiscovery object (ElasticRayExecutor's)
        self.hosts = parse_hosts(hosts, slots_per_host) if isinstance(hosts, str) else \
            (dict(hosts) if hosts is not None else None)
        if self.hosts is not None:
            StaticDiscovery(self.hosts)  # checks the slots
            if host_discovery_script is not None:
                raise ConfigError("give hosts or host_discovery_script, not both")
            if num_hosts is not None:
                raise ConfigError("give hosts or num_hosts, not both")
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise ConfigError(f"name must be a non-empty string, got {name!r}")
        self.name = name
        self.checkpoint_name = checkpoint_name(name)
        self.checkpoint = for_job(checkpoint, self.checkpoint_name)
        self.metrics: DriverMetrics | None = None
        self.last_elastic_job = None
        self._elastic_env: dict[str, str] | None = None
        self._static: StaticJob | None = None
        self.autotune_controller = None
        self._lease_keeper: tuple[Any, Any] | None = None  # (LeaseKeeper, its renewal)

    # ------------------------------------------------------------------ lifecycle
    @property
    def world_size(self) -> int:
        if self.num_hosts is not None:
            return self.num_hosts * self.num_workers_per_host
        return int(self.num_workers)

    @property
    def workers(self) -> list[Any]:
        """A fixed world's worker actors, in rank order (empty before `start`)."""
        return self._static.workers if self._static is not None else []

    @property
    def slots(self) -> list[Slot]:
        """Each rank's node and local/cross ranks, in rank order."""
        return self._static.slots if self._static is not None else []

    def start(self, executable_cls: type | None = None, executable_args: Sequence | None = None,
              executable_kwargs: dict | None = None,
              extra_env_vars: dict[str, str] | None = None) -> None:
        """Places the workers, forms the world's rendezvous and builds the executables. A
        start that fails frees what it had started (workers, placement group, autotune
        actor, metrics) before it raises, and the executor can be started again."""
        if self._static is not None or self._elastic_env is not None:
            raise ConfigError("this executor is already started; call shutdown() first")
        bad = {k: v for k, v in (extra_env_vars or {}).items()
               if not isinstance(k, str) or not isinstance(v, str)}
        if bad:
            raise ConfigError(f"extra_env_vars takes strings, as os.environ does; got {bad} "
                              "(pass str(value))")
        try:
            self._start(executable_cls, executable_args, executable_kwargs, extra_env_vars)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, executable_cls: type | None, executable_args: Sequence | None,
               executable_kwargs: dict | None, extra_env_vars: dict[str, str] | None) -> None:
        apply_verbose(self.settings.verbose)
        ensure_ray()
        self.name = self.name or job_name()
        run = uuid.uuid4().hex  # this run's writer token
        if self.checkpoint is not None:
            from raytrain_x.elastic.checkpoints import probe

            probe(self.checkpoint)  # an unwritable path fails the start, not the 1st write
            self._keep_lease(run)
        # the workers export metrics where the driver does, under the job's name; their
        # checkpoints take the driver's folder and this run's writer token
        env = {**(extra_env_vars or {}), TIMEOUT_S.env: str(self.settings.timeout_s),
               JOB_NAME.env: self.name, CHECKPOINT_NAME.env: self.checkpoint_name,
               CHECKPOINT_RUN.env: run, DRIVER_DIR.env: driver_dir(),
               CHECKPOINT_DRIVER.env: self._lease_keeper[0].lease.driver
               if self._lease_keeper else "",
               METRICS.env: "1" if metrics.enabled() else "0",
               **(knob_env(self.knobs) if self.knobs else {}),
               **(self.checkpoint.to_env() if self.checkpoint is not None else {})}
        if metrics.enabled():
            self.metrics = DriverMetrics(self.name, metrics.RayRecorder()).start(
                METRICS_INTERVAL_S.read())
        if self.elastic:  # workers are started by each run(), as capacity allows
            if executable_cls is not None:
                raise ConfigError("elastic executors run functions; executable_cls needs a "
                                  "fixed set of workers (drop min_workers/max_workers)")
            if self.autotune is not None:
                env.update(self._start_autotune())
            self._elastic_env = env
            return
        if self.autotune is not None and self.autotune_controller is None:
            env.update(self._start_autotune())
        shape = StaticShape(self.num_workers, self.num_hosts, self.num_workers_per_host,
                            self.cpus_per_worker, self.gpus_per_worker if self.use_gpu else 0,
                            self.resources_per_worker, self.use_current_placement_group,
                            self.settings.placement_group_timeout_s, self.hosts)
        self._static = StaticJob(shape, self.settings.timeout_s)
        self._static.start(env, self.autotune_controller)
        if self.metrics is not None:
            metrics.safe(self.metrics.world_size)(self.world_size)
        if executable_cls is not None:
            self._static.create_executables(executable_cls, executable_args or (),
                                            executable_kwargs or {})

    def _start_autotune(self) -> dict[str, str]:
        """Starts the controller actor; returns the env for every worker."""
        env, self.autotune_controller = start_autotune(self.autotune, self.knobs)
        return env

    def _keep_lease(self, run: str) -> None:
        """The driver renews the writer lease its run's rank 0 takes (`LeaseKeeper`): the
        job holds it while a recovery waits for capacity or after rank 0 died."""
        from raytrain_x.common.periodic import Every
        from raytrain_x.elastic.checkpoints import CheckpointStore
        from raytrain_x.elastic.lease import RENEW_S, LeaseKeeper

        assert self.checkpoint is not None
        if self._lease_keeper:  # started again: the last run's keeper ends
            self._lease_keeper[1].stop()
        keeper = LeaseKeeper(CheckpointStore(self.checkpoint), run)
        self._lease_keeper = (keeper, Every(RENEW_S, keeper.renew,
                                            "raytrain-x-lease-keeper").start())

    def shutdown(self) -> None:
        """Kills the workers and frees their placement group."""
        if self._lease_keeper:
            keeper, renewal = self._lease_keeper
            renewal.stop()
            keeper.stop()  # the run ended: the next one takes the lease at once
            self._lease_keeper = None
        self._elastic_env = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self._static is not None:
            self._static.shutdown()
            self._static = None
        if self.autotune_controller is not None:
            ray.kill(self.autotune_controller, no_restart=True)
            self.autotune_controller = None

    def __enter__(self) -> RayExecutor:
        if self._static is None and self._elastic_env is None:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ running
    def _started(self) -> StaticJob:
        if self._static is None:
            raise ConfigError("the executor is not started; call start() first")
        return self._static

    def _run_elastic(self, fn: Callable, args: Sequence | None, kwargs: dict | None) -> list:
        if self._elastic_env is None:
            raise ConfigError("the executor is not started; call start() first")
        settings = ElasticSettings(
            min_workers=self.min_workers, max_workers=self.max_workers,
            cpus_per_worker=self.cpus_per_worker,
            gpus_per_worker=self.gpus_per_worker if self.use_gpu else 0,
            resources_per_worker=self.resources_per_worker, reset_limit=self.reset_limit,
            cooldown_range=self.cooldown_range, elastic_timeout=self.elastic_timeout,
            timeout_s=self.settings.timeout_s, discovery_script=self.host_discovery_script,
            hosts=self.hosts, slots_per_host=self.slots_per_host,
            discovery=self.host_discovery,
            env=self._elastic_env, autotune_actor=self.autotune_controller,
            start_timeout_s=self.start_timeout_s, checkpoint=self.checkpoint,
            max_failures=self.max_failures, discovery_interval_s=self.discovery_interval_s,
            policies=self.policies)

        def new_job() -> ElasticJob:
            job = self.last_elastic_job = ElasticJob(settings, fn, tuple(args or ()),
                                                     dict(kwargs or {}))
            if self.metrics is not None:
                self.metrics.blacklisted = lambda: len(job.blacklist.blacklisted())
                job.log.listeners.append(metrics.safe(self.metrics.on_event))
            return job
        return run_job(settings, new_job)

    @property
    def elastic_history(self) -> list[dict[str, Any]]:
        """The last elastic run's rounds, one dict each (docs/elastic.md, "The
        cluster's shape"): `round`, `time_s`, `size`, `hosts`, `reason`, `joined`, `failed`, `left`,
        `starting`, `requested`, `draining_nodes`, `restored_from`."""
        job = self.last_elastic_job
        return [dict(entry) for entry in job.history] if job is not None else []

    def worker_status(self, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """Each current worker's status (`raytrain_x.core.status.snapshot`: its steps, rank,
        world size, engine counters and, on rank 0, autotune's state), in rank order;
        workers that have none yet or do not answer within `timeout_s` are left out."""
        if self.elastic:
            job = self.last_elastic_job
            actors = [m.actor for m in list(job.members.values())] if job is not None else []
        else:
            actors = self.workers
        refs = [actor.status.remote() for actor in actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        found = []
        for ref in ready:
            try:
                snap = ray.get(ref)
            except ray.exceptions.RayError:  # gone meanwhile
                continue
            if snap is not None:
                found.append(snap)
        return sorted(found, key=lambda s: (s["rank"] is None, s["rank"] or 0))

    def run_remote(self, fn: Callable, args: Sequence | None = None,
                   kwargs: dict | None = None) -> list[ray.ObjectRef]:
        """Starts `fn(*args, **kwargs)` on every worker; returns ObjectRefs in rank order."""
        job = self._started()
        if not callable(fn):
            raise ConfigError(f"run needs a function, got {type(fn).__name__}")
        return job.run_remote(fn, args, kwargs)

    def run(self, fn: Callable, args: Sequence | None = None, kwargs: dict | None = None,
            callbacks: Sequence[Callable[[Any], None]] | None = None) -> list[Any]:
        """Runs `fn` on every worker and returns the results in rank order.

        Args:
            callbacks: called on the driver with each value a worker logs with
                `raytrain_x.ray.ray_logger.log(info)`, as it arrives (Horovod's): rank 0's
                in a fixed job, every worker's in an elastic one.

        Raises:
            WorkerError: a rank raised or exited; names the rank and its traceback. The
                other ranks are released (their engines stop) within `timeout_s`.
        """
        if not callbacks:
            return self._run(fn, args, kwargs)
        with Relay(callbacks, rank0_only=not self.elastic) as relay:
            return self._run(relay.wrap(fn), args, kwargs)

    def _run(self, fn: Callable, args: Sequence | None, kwargs: dict | None) -> list[Any]:
        if self.elastic:
            return self._run_elastic(fn, args, kwargs)
        return self.collect(self.run_remote(fn, args, kwargs))

    def execute(self, fn: Callable[[Any], Any],
                callbacks: Sequence[Callable[[Any], None]] | None = None) -> list[Any]:
        """Runs `fn(executable)` on every worker's executable; results in rank order.
        `callbacks`: as `run`'s."""
        job = self._started()
        if not callbacks:
            return job.collect(job.execute_remote(fn, range(len(job.workers))))
        with Relay(callbacks, rank0_only=True) as relay:
            refs = job.execute_remote(relay.wrap(fn), range(len(job.workers)))
            return job.collect(refs)

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """Runs `fn(executable)` on rank 0 only."""
        job = self._started()
        return job.collect(job.execute_remote(fn, [0]))[0]

    def collect(self, refs: list[ray.ObjectRef]) -> list[Any]:
        """Waits for per-rank ObjectRefs from `run_remote`; returns results in rank order.

        Raises:
            WorkerError: the root-cause failure; ranks still running `timeout_s` after it
                are killed.
        """
        return self._started().collect(refs)


def checkpoint_name(name: str | None) -> str:
    """The folder of a job's durable checkpoints where its `CheckpointConfig` names none:
    the job's name, else `RAYTRAIN_X_JOB_NAME` (or the folder `raytrain-x run` settled from
    the script's command), else the Tune trial's name, else the driver's command."""
    given = name or JOB_NAME.read() or CHECKPOINT_NAME.read()
    if given:
        return given
    if "ray.tune" in sys.modules:
        try:
            trial = sys.modules["ray.tune"].get_context().get_trial_name()
        except Exception:  # noqa: BLE001 - not inside a trial
            trial = None
        if trial:
            return str(trial)
    return entrypoint_name()
