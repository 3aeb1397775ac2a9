"""The `raytrain-x` command: `raytrain-x run -np N [flags] python train.py [args]`."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from raytrain_x import cli_horovod
from raytrain_x.common import settings
from raytrain_x.common.autotune_config import AutotuneConfig
from raytrain_x.common.errors import ConfigError, RaytrainXError
from raytrain_x.common.knobs import Knobs, load_knobs
from raytrain_x.common.settings import START_TIMEOUT_S, TIMEOUT_S, Setting, check_seconds


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def _add_flag(group: Any, setting: Setting, dest: str, default: Any = None) -> None:
    """A flag for `setting` (its type, unit and meaning from `raytrain_x.common.settings`)."""
    if setting.kind is bool:
        group.add_argument(setting.flag, dest=dest, action=argparse.BooleanOptionalAction,
                           default=default, help=setting.doc)
        return
    kind = float if setting.flag_scale != 1 else setting.kind
    metavar = "MB" if setting.flag_scale != 1 else \
        {str: "PATH", int: "N"}.get(kind, "S" if setting.seconds else "X")
    group.add_argument(setting.flag, dest=dest, type=kind, default=default, metavar=metavar,
                       help=setting.doc)


def _add_knob_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("communication knobs (flag > env > config file)")
    for name, spec in Knobs.specs().items():
        _add_flag(group, spec.var, name)
    _add_flag(group, settings.CONFIG_FILE, "config_file")
    _add_flag(group, settings.TIMELINE, "timeline_filename")


def _add_autotune_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("autotune (flag > RAYTRAIN_X_AUTOTUNE* env)")
    group.add_argument(settings.AUTOTUNE.flag, action="store_true", default=None,
                       help=settings.AUTOTUNE.doc)
    for name, setting in AutotuneConfig.field_settings().items():
        _add_flag(group, setting, f"autotune_{name}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="raytrain-x", description=__doc__)
    sub = parser.add_subparsers(dest="command_name", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="run a training script on N workers",
                         description="Runs COMMAND on N Ray workers joined into one world.")
    run.add_argument("-np", "--num-proc", dest="np", type=int,
                     help="number of workers (required)")
    run.add_argument("--address", help="Ray cluster address; 'auto' joins the one running "
                     "on this machine (default: RAY_ADDRESS, else a new local Ray for this job)")
    run.add_argument("--cpus-per-worker", type=float, default=1.0)
    run.add_argument("--use-gpu", action="store_true")
    _add_flag(run, TIMEOUT_S, "timeout", TIMEOUT_S.default)
    run.add_argument("--verbose", action="store_true")
    run.add_argument("--quiet", action="store_true",
                     help="no progress lines (steps/s, world size, autotune's phase)")
    run.add_argument("--progress-every", type=float, default=30.0, metavar="S",
                     help="seconds between progress lines (default 30)")
    run.add_argument("--job-name", help="the job's name in its metrics (the `job` tag; "
                     "default: the Ray job's id)")
    durable = run.add_argument_group("durable checkpoints of rx.elastic.TorchState "
                                     "(docs/elastic.md)")
    durable.add_argument("--checkpoint-path", metavar="PATH_OR_URI",
                         help="write the state's commits here in the background (a folder, "
                         "s3://bucket/prefix, gs://...); the same command run again resumes "
                         "from the latest; the folder is named by --job-name")
    durable.add_argument("--checkpoint-every", type=float, default=300.0, metavar="S",
                         help="seconds between checkpoints (default 300)")
    durable.add_argument("--checkpoint-keep", type=int, default=2, metavar="N",
                         help="complete checkpoints kept (default 2)")
    elastic = run.add_argument_group("elastic (any of these makes the job elastic)")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int,
                         help="fewest workers to train with (default: -np, as horovodrun)")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int,
                         help="most workers to scale up to (default: -np)")
    elastic.add_argument("--host-discovery-script",
                         help="executable printing 'host:slots' lines (default: Ray's nodes)")
    elastic.add_argument("--blacklist-cooldown-range", type=float, nargs=2,
                         metavar=("LO", "HI"), help="seconds a failed host stays out")
    elastic.add_argument("--reset-limit", type=int, help="most resets before the job fails")
    elastic.add_argument("--elastic-timeout", type=float, default=600.0,
                         help="seconds to wait for min-np workers")
    _add_flag(elastic, START_TIMEOUT_S, "start_timeout", START_TIMEOUT_S.read())
    _add_knob_flags(run)
    _add_autotune_flags(run)
    cli_horovod.add_flags(run, _add_flag)
    run.add_argument("command", nargs=argparse.REMAINDER, help="the command to run")
    report = sub.add_parser("autotune-report", help="summarise an autotune log",
                            description="Prints the samples of an autotune log and plots "
                            "score per sample with the best-so-far curve.")
    report.add_argument("log", help="autotune log CSV")
    report.add_argument("--plot", help="write a PNG here")
    dash = sub.add_parser("dashboard", help="the Grafana dashboard of the jobs' metrics",
                          description="Writes the Grafana dashboard of raytrain-x's metrics "
                          "(docs/metrics.md): to stdout, to --out, or with --install into "
                          "the folder Ray's Grafana provisioning reads.")
    where = dash.add_mutually_exclusive_group()
    where.add_argument("--out", help="write the dashboard's JSON here")
    where.add_argument("--install", action="store_true",
                       help="put it beside Ray's own dashboards (the Ray session on this "
                       "machine; RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR if set)")
    dash.add_argument("--ray-temp-dir", default="/tmp/ray",
                      help="Ray's temp dir, whose session_latest --install uses")
    exp = sub.add_parser("tune-experiments", help="short experiments to pick settings",
                         description="Runs FN (module:function, called with a config dict on "
                         "every worker) once per configuration of SPACE on Ray Tune.")
    exp.add_argument("--fn", required=True, help="module:function, e.g. train:step_fn")
    exp.add_argument("--space", required=True,
                     help='JSON: name -> list of values or [low, high] with --search bayesopt')
    exp.add_argument("-np", "--num-workers", dest="np", type=int, default=2)
    exp.add_argument("--metric", default="samples_per_sec")
    exp.add_argument("--mode", choices=["max", "min"], default="max")
    exp.add_argument("--search", choices=["bayesopt", "grid", "zero"], default="bayesopt",
                     help="zero: DeepSpeed's fast mode over zero_stage and micro_batch_size")
    exp.add_argument("--max-memory-per-worker", type=float,
                     help="MB: an experiment whose peak memory exceeds it fails")
    exp.add_argument("--global-batch-size", type=int,
                     help="kept by gradient_accumulation_steps across micro-batch sizes")
    exp.add_argument("--max-experiments", type=int, default=10)
    exp.add_argument("--steps-per-experiment", type=int, default=10)
    exp.add_argument("--start-step", type=int, default=2)
    exp.add_argument("--early-stop-patience", type=int)
    exp.add_argument("--output-dir", default="raytrain_x_experiments")
    exp.add_argument("--address", help="Ray cluster address")
    return parser


def resolve_autotune(args: argparse.Namespace) -> AutotuneConfig | None:
    """Autotune settings from flags over env; None when autotune is off."""
    from_env = AutotuneConfig.from_env()
    flags = {name: getattr(args, f"autotune_{name}")
             for name in AutotuneConfig.field_settings()
             if getattr(args, f"autotune_{name}") is not None}
    if not (args.autotune or from_env or flags.get("resume_from")):
        if flags:
            raise ConfigError(f"{sorted(flags)} need --autotune (or RAYTRAIN_X_AUTOTUNE=1)")
        return None
    base = from_env.fields() if from_env else {}
    base.pop("initial_knobs", None)
    return AutotuneConfig(**{**base, **flags})


def resolve_knobs(args: argparse.Namespace) -> tuple[Knobs, frozenset[str]]:
    """Knobs from flags (in their flags' units), env and the config file."""
    flags = {name: getattr(args, name) for name in Knobs.specs()}
    return load_knobs(flags=flags, config_file=args.config_file)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command_name == "run":
            return _run(args, parser)
        if args.command_name == "tune-experiments":
            return _tune_experiments(args)
        if args.command_name == "autotune-report":
            from raytrain_x.autotune.report import autotune_report

            autotune_report(args.log, args.plot)
            return 0
        if args.command_name == "dashboard":
            return _dashboard(args)
    except ConfigError as exc:
        sys.stderr.write(f"raytrain-x: error: {exc}\n")
        return 2
    except RaytrainXError as exc:
        sys.stderr.write(f"raytrain-x: {exc}\n")
        return 1
    except KeyboardInterrupt:  # the workers were stopped on the way out (`finally`)
        sys.stderr.write("raytrain-x: interrupted; the job's workers are stopped\n")
        return 130
    return 0


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.version:
        from raytrain_x import __version__

        print(__version__)
        return 0
    if args.check_build:
        print(cli_horovod.check_build())
        return 0
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if args.np is None:
        parser.error("the following arguments are required: -np/--num-proc")
    if not command:
        parser.error("run needs a command, e.g. raytrain-x run -np 2 python train.py")
    if args.np < 1:
        parser.error(f"-np must be >= 1, got {args.np}")
    if os.sep not in command[0] and shutil.which(command[0]) is None:
        parser.error(f"command {command[0]!r} not found on PATH (raytrain-x run -np N python "
                     "train.py runs `python train.py` on every worker)")
    cli_horovod.warn_ignored(args)
    hosts = cli_horovod.host_list(args)
    try:
        for flag in ("timeout", "progress_every", "elastic_timeout", "start_timeout"):
            check_seconds("--" + flag.replace("_", "-"), getattr(args, flag))
    except ConfigError as exc:
        parser.error(str(exc))
    knobs, fixed = resolve_knobs(args)
    autotune = resolve_autotune(args)
    # durable checkpoints' folder, where nothing names it: the script's command, not this
    # one's (another -np resumes the same job at another size)
    from raytrain_x.common.checkpoint_config import entrypoint_name

    os.environ.setdefault(settings.CHECKPOINT_NAME.env, entrypoint_name(command))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="raytrain-x %(levelname)s %(message)s")
    if args.log_level:
        from raytrain_x.common.logs import apply_log_level

        apply_log_level(args.log_level)

    from raytrain_x.ray.autotune_actor import fixed_knob_env
    from raytrain_x.ray.executor import RayExecutor, ensure_ray
    from raytrain_x.ray.launch import run_command_on_workers

    elastic = args.min_np is not None or args.max_np is not None
    start = time.monotonic()
    connected = ensure_ray(args.address, log_to_driver=args.verbose or elastic,
                           logging_level=logging.INFO if args.verbose else logging.WARNING)
    _progress(f"{connected.line}; ready in {time.monotonic() - start:.1f}s")
    if connected.started:  # a Ray of its own cannot grow: too many workers fail now
        from raytrain_x.ray.connect import check_fits_local

        check_fits_local(_min_np(args) if elastic else args.np, args.cpus_per_worker,
                         1.0 if args.use_gpu else 0.0)
    run_settings = RayExecutor.create_settings(timeout_s=args.timeout)
    if elastic:
        return _run_elastic(args, command, run_settings, knobs, fixed, autotune, hosts)
    executor = RayExecutor(run_settings, num_workers=args.np, cpus_per_worker=args.cpus_per_worker,
                           use_gpu=args.use_gpu, name=args.job_name,
                           checkpoint=_checkpoint(args), hosts=hosts)
    # Only the knobs the user fixed travel as env, so the launched ranks see the same fixed
    # set; rank 0 of a launched script runs the autotune controller in-process.
    env = {**fixed_knob_env(knobs, fixed), **_training_env(args)}
    if autotune is not None:
        env.update(autotune.to_env())
    if args.timeline_filename:
        env[settings.TIMELINE.env] = os.path.abspath(args.timeline_filename)
    start = time.monotonic()
    executor.start(extra_env_vars=env)
    reporter = None
    try:
        _progress(f"{args.np} workers ready in {time.monotonic() - start:.1f}s")
        reporter = _start_reporter(args, executor)
        codes = run_command_on_workers(
            executor, command, env,
            _printer(args.prefix_output_with_timestamp,
                     cli_horovod.output_writer(args.output_filename)), os.getcwd())
    finally:
        if reporter is not None:
            reporter.stop()
        executor.shutdown()
    failed = {rank: r for rank, r in enumerate(codes) if r["code"] != 0}
    if failed:  # report the root cause (the executor's rule: failures.root_cause_order)
        from raytrain_x.ray.failures import root_cause_order

        rank = min(failed, key=lambda k: root_cause_order(failed[k]["lost_peer"], k,
                                                          failed[k]["ended"]))
        code = failed[rank]["code"]
        sys.stderr.write(f"raytrain-x: rank {rank} exited with code {code}\n")
        return code if 0 < code < 256 else 1
    return 0


def _start_reporter(args: argparse.Namespace, executor: Any) -> Any:
    """A progress line every `--progress-every` seconds on stderr, unless `--quiet`."""
    if args.quiet:
        return None
    from raytrain_x.ray.job_progress import ProgressReporter

    def emit(line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    return ProgressReporter(executor.worker_status, args.progress_every, emit).start()


def _progress(line: str) -> None:
    """The set-up steps that can take a while on a busy machine, one line each on stderr."""
    sys.stderr.write(f"raytrain-x: {line}\n")
    sys.stderr.flush()


def _training_env(args: argparse.Namespace) -> dict[str, str]:
    """The workers' environment from here: the settings (`common/settings.py`) set where
    `raytrain-x run` runs, as horovodrun passes its environment on, and the config file's
    training settings (ZeRO stage, micro-batch, accumulation; `raytrain_x.training_settings()`
    reads them there)."""
    from raytrain_x.common import training
    from raytrain_x.common.knobs import read_training_settings

    # the knobs and autotune's settings travel resolved (flags over env), not as found here
    resolved = {spec.var for spec in Knobs.specs().values()} | {settings.AUTOTUNE} | \
        set(AutotuneConfig.field_settings().values())
    passed = [s for s in settings.ALL if s not in resolved and (
        s.scope == settings.USER or s in (settings.JOB_NAME, settings.CHECKPOINT,
                                          settings.CHECKPOINT_NAME))]
    env = {s.env: os.environ[s.env] for s in passed if s.env in os.environ}
    env.update(cli_horovod.worker_env(args))
    if not args.config_file:
        return env
    return {**env, **training.to_env(read_training_settings(args.config_file))}


def _checkpoint(args: argparse.Namespace):
    """The `CheckpointConfig` of `--checkpoint-path` (None without it)."""
    from raytrain_x.common.checkpoint_config import CheckpointConfig

    if not args.checkpoint_path:
        return None
    return CheckpointConfig(args.checkpoint_path, every_s=args.checkpoint_every,
                            keep=args.checkpoint_keep)


def _min_np(args: argparse.Namespace) -> int:
    """An elastic job's least workers: horovodrun's default, -np for both bounds unless
    given."""
    return args.min_np if args.min_np is not None else min(args.np, args.max_np or args.np)


def _run_elastic(args, command, run_settings, knobs, fixed, autotune, hosts) -> int:
    """Elastic jobs run the script inside each worker actor (so every rank can reach the
    rendezvous coordinator); Ray forwards the output with its worker prefix."""
    from raytrain_x.ray.autotune_actor import fixed_knob_env
    from raytrain_x.ray.executor import RayExecutor
    from raytrain_x.ray.launch import run_script

    env = {**fixed_knob_env(knobs, fixed), **_training_env(args)}
    if args.timeline_filename:
        env[settings.TIMELINE.env] = os.path.abspath(args.timeline_filename)
    if args.output_filename:
        sys.stderr.write("raytrain-x: warning: --output-filename applies to fixed jobs; an "
                         "elastic job's script runs in its worker actors, whose output Ray "
                         "keeps in its session's logs/ folder\n")
    min_np = _min_np(args)
    executor = RayExecutor(
        run_settings, cpus_per_worker=args.cpus_per_worker,
        use_gpu=args.use_gpu, min_workers=min_np,
        max_workers=args.max_np if args.max_np is not None else max(args.np, min_np),
        reset_limit=args.reset_limit,
        cooldown_range=tuple(args.blacklist_cooldown_range)
        if args.blacklist_cooldown_range else None,
        elastic_timeout=args.elastic_timeout, start_timeout_s=args.start_timeout,
        host_discovery_script=args.host_discovery_script, autotune=autotune,
        name=args.job_name, checkpoint=_checkpoint(args), hosts=hosts,
        slots_per_host=args.slots_per_host)
    executor.start(extra_env_vars=env)
    reporter = _start_reporter(args, executor)
    try:
        codes = executor.run(run_script, args=(command, os.getcwd()))
    finally:
        if reporter is not None:
            reporter.stop()
        executor.shutdown()
    return 0 if all(code == 0 for code in codes) else 1


def _tune_experiments(args: argparse.Namespace) -> int:
    import importlib
    import json

    from raytrain_x.ray.executor import ensure_ray
    from raytrain_x.tune_integration.experiments import autotune_experiments

    module_name, _, fn_name = args.fn.partition(":")
    if not fn_name:
        raise ConfigError(f"--fn {args.fn!r} must look like module:function")
    sys.path.insert(0, os.getcwd())
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--fn {args.fn!r} could not be loaded: {exc}") from None
    try:
        raw = json.loads(args.space)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--space is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError("--space must be a JSON object: name -> values")
    space = {k: tuple(v) if args.search == "bayesopt" and isinstance(v, list) and len(v) == 2
             and all(isinstance(x, (int, float)) for x in v) else v for k, v in raw.items()}
    ensure_ray(args.address, runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    result = autotune_experiments(
        fn, space, num_workers=args.np, metric=args.metric, mode=args.mode,
        max_experiments=args.max_experiments, steps_per_experiment=args.steps_per_experiment,
        start_step=args.start_step, search=args.search,
        early_stop_patience=args.early_stop_patience, output_dir=args.output_dir,
        max_memory_per_worker=args.max_memory_per_worker,
        global_batch_size=args.global_batch_size)
    return 0 if result.best is not None else 1


def _dashboard(args: argparse.Namespace) -> int:
    import json

    from raytrain_x.ray import grafana

    if args.install:
        folder = os.environ.get("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR") or \
            grafana.ray_dashboards_folder(os.path.join(args.ray_temp_dir, "session_latest"))
        if not os.path.isdir(os.path.dirname(folder)):
            raise ConfigError(f"no Ray session's Grafana folder at {os.path.dirname(folder)}: "
                              "start Ray on this machine first (ray start --head), or give "
                              "--ray-temp-dir, or write the file with --out")
        os.makedirs(folder, exist_ok=True)
        args.out = os.path.join(folder, "raytrain_x_dashboard.json")
    if args.out:
        _progress(f"dashboard written to {grafana.write(args.out)}")
    else:
        print(json.dumps(grafana.dashboard(), indent=2))
    return 0


def _printer(timestamps: bool = False, also: Any = None):
    """Each rank's output line as horovodrun prints it (`[rank]<stdout>:line`), with the
    time first (`--prefix-output-with-timestamp`), and to `also(rank, line)` too."""
    lock = threading.Lock()

    def emit(rank: int, line: str) -> None:
        stamp = time.strftime("%a %b %d %H:%M:%S %Y") + ":" if timestamps else ""
        with lock:
            print(f"{stamp}[{rank}]<stdout>:{line}", flush=True)
            if also is not None:
                also(rank, line)

    return emit


if __name__ == "__main__":
    sys.exit(main())
