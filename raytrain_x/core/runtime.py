"""What `init()` does and what the world answers: the rendezvous, the process groups, the
engine and rank 0's autotune sampler, kept in this process's state (`common.process`).
Framework faces (`raytrain_x.torch`, ...) call into this module; it knows no framework."""

from __future__ import annotations

import atexit
import logging
import math
import os
import sys
from collections.abc import Callable

from raytrain_x.autotune.host import local_controller
from raytrain_x.autotune.observer import BATCHING_FIXED_BUCKETS, BATCHING_RUNS, JobShape
from raytrain_x.autotune.sampler import AutotuneSampler
from raytrain_x.comm.groups import ProcessGroups
from raytrain_x.comm.rendezvous import Rendezvous, rendezvous_from_env
from raytrain_x.common import settings
from raytrain_x.common.autotune_config import AutotuneConfig
from raytrain_x.common.autotune_log import load_best_knobs
from raytrain_x.common.errors import LOST_PEER_ERRORS, LOST_PEER_EXIT_CODE, ConfigError
from raytrain_x.common.knobs import Knobs, load_knobs
from raytrain_x.common.logs import apply_log_level
from raytrain_x.common.process import PROCESS, StepClock, World
from raytrain_x.common.process import mark_step as mark_step  # the step clock's; re-exported
from raytrain_x.engine.engine import Engine, EngineStats

log = logging.getLogger("raytrain_x.elastic")
_P = PROCESS


def _engine() -> Engine | None:
    world = _P.world
    return world.engine if world is not None else None


def set_rendezvous_provider(provider: Callable[[], Rendezvous] | None) -> None:
    """Installs (or removes) the function `init()` calls to join the next round."""
    _P.rendezvous_provider = provider


def next_rendezvous() -> Rendezvous:
    """The rendezvous for this process: the installed provider's, else the environment's
    (`RAYTRAIN_X_RANK`, `_SIZE`, `_LOCAL_RANK`, ..., `_STORE_ADDR`, `_STORE_PORT`), else a
    world of one."""
    if _P.rendezvous_provider is not None:
        return _P.rendezvous_provider()
    with _P.lock:
        _P.env_rounds += 1  # init() after shutdown(): a fresh key space in the same store
        return rendezvous_from_env(os.environ, _P.env_rounds)


def step_clock() -> StepClock:
    """This process's training steps (every round's, since it started)."""
    return _P.steps


def batch_size() -> int | None:
    """Each rank's batch size, where the job told autotune (`autotune_batch_size`)."""
    return _P.batch_size


def set_host_update_probe(probe: Callable[[], tuple[int, bool]] | None) -> None:
    """Installs how rank 0 reads the elastic driver's host-set version and whether the
    driver asks for a durable checkpoint of this commit."""
    _P.host_update_probe = probe


def host_update_probe() -> Callable[[], tuple[int, bool]] | None:
    return _P.host_update_probe


def set_autotune_advisor_factory(factory: Callable | None) -> None:
    """Installs how rank 0 reaches the autotune controller (the Ray executor installs a
    client of its controller actor); without one, rank 0 runs the controller in-process:
    `factory(config, knobs, fixed_knobs)` returns an `Advisor`."""
    _P.advisor_factory = factory


def start(
    knobs: Knobs | None = None,
    rendezvous: Rendezvous | None = None,
    autotune: AutotuneConfig | None | bool = None,
) -> bool:
    """Joins the world and starts the engine (`raytrain_x.core.world.init` is the public
    form); returns False when it was running already."""
    with _P.lock:
        old = _engine()
        if old is not None and old.error is None:
            return False
        if old is not None:
            shutdown()
        if knobs is None:
            knobs, fixed = load_knobs(config_file=settings.CONFIG_FILE.read() or None)
        else:
            fixed = frozenset(Knobs.specs())
        if autotune is False:
            config = None
        else:
            config = autotune if autotune is not None else AutotuneConfig.from_env()
        if config is not None and config.resume_from:
            # resume at a finished search's best knobs; knobs fixed by the user still win
            best = load_best_knobs(config.resume_from)
            knobs = best.replace(**{n: getattr(knobs, n) for n in fixed})
            config = None
        elif config is not None and config.initial_knobs is not None:
            knobs = config.initial_knobs.replace(
                **{n: getattr(knobs, n) for n in fixed})
        apply_log_level(settings.LOG_LEVEL.read())
        if settings.LAUNCHED.read():
            _exit_with_code_on_lost_peer()
        rdv, groups, knobs = _form_world(rendezvous, knobs)
        engine = Engine(
            groups,
            knobs,
            timeline_path=settings.TIMELINE.read() or None,
            stall_warning_s=settings.STALL_WARNING_S.read() or math.inf,  # 0: no check
            stall_shutdown_s=(settings.STALL_SHUTDOWN_S.read()
                              if settings.STALL_WARNING_S.read() else 0.0),
            timeline_mark_cycles=settings.TIMELINE_MARK_CYCLES.read(),
        )
        world = World(engine, fixed)
        if config is not None and rdv.rank == 0:
            advisor = (_P.advisor_factory or local_controller)(config, knobs, fixed)
            shape = JobShape(size=rdv.size, multi_level=engine.multi_level(),
                             hierarchical_allreduce=engine.hierarchical_allreduce_applies)
            if _P.latest_sampler is not None:  # a reset: what it scored stays on record
                _P.retired_samples.extend(_P.latest_sampler.samples)
            sampler = AutotuneSampler(config, advisor, engine.request_knobs, shape=shape)
            world.sampler = _P.latest_sampler = sampler
            sampler.batching.update(_P.batching)
            if _P.batch_size:
                sampler.samples_per_step = _P.batch_size * rdv.size
            engine.add_cycle_hook(sampler.on_cycle)
        _P.world = world  # the whole world at once: a reset replaced the one before
        _P.steps.new_world()
        return True


def _form_world(rendezvous: Rendezvous | None,
                knobs: Knobs) -> tuple[Rendezvous, ProcessGroups, Knobs]:
    """Meets the other ranks: the groups of this round and rank 0's knobs. In an elastic
    worker (its rounds come from the driver) a peer lost while the world forms is one
    more reset: the worker joins the next round the driver forms without it, as it does
    when a peer is lost later; the first `init()` is thus as elastic as the rest."""
    while True:
        rdv = rendezvous or next_rendezvous()
        groups = None
        try:
            groups = ProcessGroups(rdv)
            if rdv.size > 1:
                knobs = groups.world.broadcast_object(knobs, 0)
            return rdv, groups, knobs
        except LOST_PEER_ERRORS as exc:
            if groups is not None:
                groups.close()
            if rendezvous is not None or _P.host_update_probe is None:
                raise
            log.warning("raytrain-x elastic: a peer was lost while round %d formed (%s); "
                        "joining the next round", rdv.round, str(exc).splitlines()[0])


def _exit_with_code_on_lost_peer() -> None:
    """In a process launched by `raytrain-x run`: when it ends on a lost peer (an uncaught
    `InternalError` or `RendezvousTimeout`), exit with `LOST_PEER_EXIT_CODE`, so that the
    launcher reports the rank whose failure was the cause, not this one."""
    previous = sys.excepthook
    if getattr(previous, "raytrain_x", False):
        return

    def hook(kind, value, tb) -> None:
        previous(kind, value, tb)
        if isinstance(value, LOST_PEER_ERRORS):
            shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(LOST_PEER_EXIT_CODE)

    hook.raytrain_x = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def shutdown() -> None:
    """Stops the engine (on every rank at the same cycle) and drops the process groups."""
    with _P.lock:
        world, _P.world = _P.world, None
        if world is not None:
            world.engine.shutdown()


atexit.register(shutdown)


def is_initialized() -> bool:
    """Whether `init()` has run in this process (and `shutdown()` has not since)."""
    return _P.world is not None


def engine() -> Engine:
    """The running engine; raises a clear error before `init()`."""
    eng = _engine()
    if eng is None:
        raise ConfigError("raytrain-x is not initialised; call init() first "
                          "(import raytrain_x.torch as rx; rx.init())")
    if eng.error is not None:
        raise eng.error
    return eng


def rendezvous() -> Rendezvous:
    """This round's rendezvous; still answers after a collective failed (as Horovod's
    `rank()`/`size()` do), so an elastic state can restore itself before the reset."""
    eng = _engine()
    if eng is None:
        return engine().groups.rdv  # the clear "call init() first" error
    return eng.groups.rdv


def engine_stats() -> EngineStats:
    """The running engine's counters (it need not be healthy: they are read after a
    failure too)."""
    eng = _engine()
    if eng is None:
        return engine().stats  # the clear "call init() first" error
    return eng.stats


def autotune_sampler() -> AutotuneSampler | None:
    """Rank 0's autotune sampler while tuning is configured (None elsewhere)."""
    world = _P.world
    return world.sampler if world is not None else None


def latest_autotune_sampler() -> AutotuneSampler | None:
    """The sampler this process made last as rank 0: the current one, or the one before an
    elastic reset that made none (None if it never tuned)."""
    return _P.latest_sampler


def autotune_samples() -> list:
    """Every autotune sample this process scored as rank 0, in order: those of the samplers
    before an elastic reset, then the latest one's."""
    sampler = _P.latest_sampler
    return [*_P.retired_samples, *(sampler.samples if sampler is not None else [])]


def autotune_batch_size(batch_size: int) -> None:
    """Tells autotune each rank's batch size, so samples score in samples per second (the
    world's: batch size x number of workers) instead of steps per second.

    Args:
        batch_size: samples per step on this rank, a positive whole number.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"autotune_batch_size needs a positive whole number, got "
                          f"{batch_size!r}")
    _P.batch_size = batch_size
    sampler = autotune_sampler()
    if sampler is not None:
        sampler.samples_per_step = batch_size * rendezvous().size


def note_gradient_batching(fixed_buckets: bool) -> None:
    """How a framework batches its gradients: in buckets of a size the user fixed, or in
    runs cut at the fusion threshold. Autotune searches the threshold where it governs what
    crosses the wire and leaves it out where nothing it governs is used."""
    kind = BATCHING_FIXED_BUCKETS if fixed_buckets else BATCHING_RUNS
    _P.batching.add(kind)
    sampler = autotune_sampler()
    if sampler is not None:
        sampler.batching.add(kind)


# ----------------------------------------------------------------- the world
def rank() -> int:
    """Global rank of this worker."""
    return rendezvous().rank


def size() -> int:
    """Number of workers."""
    return rendezvous().size


def local_rank() -> int:
    """Rank among the workers on this host."""
    return rendezvous().local_rank


def local_size() -> int:
    """Number of workers on this host."""
    return rendezvous().local_size


def cross_rank() -> int:
    """Index of this worker's host."""
    return rendezvous().cross_rank


def cross_size() -> int:
    """Number of hosts."""
    return rendezvous().cross_size


def knobs() -> Knobs:
    """The communication knobs in effect now."""
    return engine().knobs


def last_knobs() -> Knobs | None:
    """The knobs of the engine, even one that failed (None before `init`): what an
    elastic reset carries into the next round."""
    eng = _engine()
    return eng.knobs if eng is not None else None


def set_knobs(new_knobs: Knobs) -> None:
    """Requests new knobs; rank 0's request switches every rank at the same cycle (other
    ranks' requests are ignored).

    Args:
        new_knobs: a `Knobs` (for example `knobs().replace(cycle_time_ms=2)`).
    """
    engine().request_knobs(new_knobs)


