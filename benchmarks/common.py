"""Helpers every benchmark uses: timing medians, tables and JSON output."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raytrain_x.testing import results
from raytrain_x.testing.results import print_table  # noqa: F401 - the benchmarks' import
from raytrain_x.testing.waiting import free_port

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 2,
                   clock: Callable[[], float] = time.perf_counter) -> float:
    """Median time of `fn` over `repeats` runs after `warmup` untimed runs, read on `clock`
    (wall time; `time.process_time` for this process's CPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = clock()
        fn()
        samples.append(clock() - start)
    return statistics.median(samples)


def _timed_runs(fn: Callable[[], Any], repeats: int, warmup: int) -> list[float]:
    """This rank's seconds for each of `repeats` runs of `fn`, each after a barrier."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def _slowest(values: list[float]) -> list[float]:
    """Each value's maximum over the ranks of torch.distributed's default group."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def median_across_ranks(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median seconds of `fn` after a barrier each time, taken from the slowest rank (a
    collective step is as slow as its slowest member). Needs torch.distributed's default
    group."""
    return _slowest([statistics.median(_timed_runs(fn, repeats, warmup))])[0]


def samples_across_ranks(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` runs of `fn`, each started after a barrier and taken
    from the slowest rank for that run. Needs torch.distributed's default group."""
    return _slowest(_timed_runs(fn, repeats, warmup))


def rss_mib() -> float:
    """This process's resident memory now, in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def write_json(name: str, payload: dict[str, Any], path: str | None = None) -> Path:
    """Writes results to `path` (default results/<name>.json) and returns the path."""
    return results.write_json(path or RESULTS_DIR / f"{name}.json", payload)


def join_world(rank: int, size: int, port: int, extra_env: dict[str, str] | None = None) -> None:
    """Joins a benchmark world twice over: torch.distributed's default group (the
    baselines, TCP store on port+1) and raytrain-x (TCP store on port), one thread each."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update({"RAYTRAIN_X_RANK": str(rank), "RAYTRAIN_X_SIZE": str(size),
                       "RAYTRAIN_X_STORE_ADDR": "127.0.0.1", "RAYTRAIN_X_STORE_PORT": str(port),
                       **(extra_env or {})})
    store = dist.TCPStore("127.0.0.1", port + 1, size, rank == 0, timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)


def agree_knobs(**changes) -> None:
    """Rank 0 sets raytrain-x's knobs; every rank returns once it runs with them (the same
    number of collectives on every rank)."""
    import torch

    import raytrain_x.torch as rx

    if rx.rank() == 0:
        rx.set_knobs(rx.knobs().replace(**changes))
    flag = torch.zeros(1)
    while True:
        current = rx.knobs()
        flag[0] = float(all(getattr(current, k) == v for k, v in changes.items()))
        rx.allreduce_(flag, op=rx.Min, name="knob_switch")
        if flag[0] == 1:
            return


def autotune_knobs(make_step: Callable[[], Callable[[], None]], log: Path, batch_size: int,
                   what: str) -> dict:
    """Autotune with the settings users get: raytrain-x's world is made again with autotune
    on (its log written to `log`), the step `make_step()` returns (built after that) runs
    until rank 0's sampler has finished, and the world is made again without autotune.
    Returns the chosen knobs, the steps and the seconds it took."""
    import torch

    import raytrain_x.torch as rx
    from raytrain_x.common.autotune_config import AutotuneConfig
    from raytrain_x.core import runtime

    rx.shutdown()
    rx.init(autotune=AutotuneConfig(log_file=str(log)))
    rx.autotune_batch_size(batch_size)
    step = make_step()
    began, steps = time.perf_counter(), 0
    while True:
        step()
        steps += 1
        if steps % 5 == 0:
            sampler = runtime.autotune_sampler()  # rank 0's; None elsewhere
            done = torch.tensor([1.0 if sampler is None or sampler.finished else 0.0])
            if rx.allreduce(done, op=rx.Min, name="tuning_done").item() == 1.0:
                break
            if rx.rank() == 0 and steps % 50 == 0:
                say(f"{what} autotune: {steps} steps, {time.perf_counter() - began:.0f}s")
    del step
    tuned = rx.knobs().to_dict()
    rx.shutdown()
    rx.init()
    if rx.rank() == 0:
        say(f"{what} autotune chose {tuned} in {steps} steps "
            f"({time.perf_counter() - began:.0f}s); log {log}")
    return {"knobs": tuned, "steps": steps, "seconds": time.perf_counter() - began,
            "log": str(log)}


def say(message: str) -> None:
    """A line of progress, at once."""
    import sys

    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def emulated_world(measure: Callable[[], Any]) -> dict:
    """In each `RayExecutor` worker of an emulated cluster: joins raytrain-x and the
    baselines' group, runs `measure()` and leaves both; returns the transport raytrain-x
    used and what `measure` returned."""
    import torch
    import torch.distributed as dist

    import raytrain_x.torch as rx

    torch.set_num_threads(1)
    rx.init()
    join_baseline_group()
    out = measure()
    transport = rx.transport()
    dist.destroy_process_group()
    rx.shutdown()
    return {"transport": transport, "results": out}


def join_baseline_group() -> None:
    """In a `RayExecutor` worker of an emulated cluster, after `rx.init()`: joins
    torch.distributed's default group (the baselines) over the hosts' own addresses, its
    TCP store on rank 0's host."""
    import os
    from datetime import timedelta

    import ray
    import torch.distributed as dist

    import raytrain_x.torch as rx
    from raytrain_x.testing.waiting import free_port

    ip = ray.util.get_node_ip_address()
    mine = (ip, free_port(ip)) if rx.rank() == 0 else None
    master, port = rx.broadcast_object(mine, root_rank=0, name="baseline_store")
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # gloo's default is the hostname: loopback
    try:
        dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rx.rank(),
                                world_size=rx.size(), timeout=timedelta(seconds=300))
    finally:
        del os.environ["GLOO_SOCKET_IFNAME"]


def run_ranks(target: Callable[..., Any], size: int, *args: Any, timeout_s: float = 3600) -> Any:
    """Runs `target(rank, size, port, *args, queue)` in `size` spawned processes and returns
    what rank 0 put on the queue. Fails at once (not at the timeout) if a rank dies."""
    import os
    import queue as queue_mod
    import secrets

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    # raytrain-x's store answers only the world's own ranks: they inherit its secret
    os.environ["RAYTRAIN_X_STORE_SECRET"] = secrets.token_hex(16)
    procs = [ctx.Process(target=target, args=(r, size, port, *args, results))
             for r in range(size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                out = results.get(timeout=2)
                break
            except queue_mod.Empty:
                failed = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(f"benchmark ranks {failed} failed (see their traceback "
                                       "above)" if failed else "benchmark timed out") from None
        for p in procs:
            p.join()
        return out
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def multi_level_world() -> bool:
    """True when this process's world has several hosts with several workers each: where
    hierarchical allreduce applies, so the benchmarks measure it both ways."""
    import raytrain_x.torch as rx

    return rx.local_size() > 1 and rx.cross_size() > 1


def other_hierarchy_way() -> str:
    """The way that runs raytrain-x with hierarchical allreduce the other way than its
    default: "rx-flat" (off) or "rx-hier" (on). Only worlds where it applies (several
    hosts with several workers each) measure it."""
    from raytrain_x import Knobs

    return "rx-flat" if Knobs().hierarchical_allreduce else "rx-hier"


def hierarchical_of(way: str) -> bool:
    """The hierarchical_allreduce knob of a raytrain-x way: on for rx-hier, off for
    rx-flat, the default for any other."""
    from raytrain_x import Knobs

    return {"rx-hier": True, "rx-flat": False}.get(way, Knobs().hierarchical_allreduce)


def add_place_arguments(parser: Any) -> None:
    """Where an emulated-network benchmark runs: one host's --workers, or --hosts emulated
    hosts (--per-host workers each, one world per value) joined by --link-gbit links."""
    parser.add_argument("--workers", type=int, default=2, help="one host: how many ranks")
    parser.add_argument("--hosts", type=int, default=1)
    parser.add_argument("--per-host", type=int, nargs="+", default=[1, 2],
                        help="emulated hosts: workers per host, one world each")
    parser.add_argument("--link-gbit", type=float, default=1.0)


def run_emulated(script: str, argv: list[str], hosts: int, workers_per_host: int,
                 link_gbit: float) -> dict:
    """Runs `script --inside RAW argv` as the driver on host 0 of an emulated cluster
    (network namespaces, one Ray node per host, `link_gbit` links); the driver writes its
    results as JSON to RAW, which is returned (what it finished, if it failed later)."""
    import subprocess
    import sys

    from raytrain_x.testing import EmulatedCluster

    inner = RESULTS_DIR / f"{Path(script).stem}.raw.json"
    RESULTS_DIR.mkdir(exist_ok=True)
    inner.unlink(missing_ok=True)
    began = time.monotonic()
    with EmulatedCluster(hosts=hosts, workers_per_host=workers_per_host,
                         link_gbit=link_gbit) as cluster:
        print(f"emulated cluster up in {time.monotonic() - began:.1f}s: {hosts} hosts, "
              f"{link_gbit:g} Gbit/s links", flush=True)
        cmd = [sys.executable, script, "--inside", str(inner), *argv]
        finished: subprocess.CompletedProcess = cluster.run(cmd, capture_output=False,
                                                            timeout_s=6 * 3600)
    if not inner.exists():
        raise SystemExit(f"the driver on host 0 failed (exit {finished.returncode})")
    raw = json.loads(inner.read_text())
    inner.unlink()
    if finished.returncode != 0:
        print(f"the driver failed (exit {finished.returncode}); reporting what it finished")
    return raw


def drive_worlds(hosts: int, per_host: list[int], out: str,
                 run: Callable[[Any], Any]) -> None:
    """The driver on host 0 of an emulated cluster (`run_emulated`'s `--inside` side): one
    `RayExecutor` world per `per_host` value; `run(executor)` measures it, and what each
    world returned is written to `out` as JSON as soon as it is done."""
    import ray

    from raytrain_x.ray import RayExecutor

    ray.init(log_to_driver=True)
    done: dict = {}
    try:
        for k in per_host:
            ex = RayExecutor(num_hosts=hosts, num_workers_per_host=k)
            ex.start()
            try:
                done[str(k)] = run(ex)
            finally:
                ex.shutdown()
            Path(out).write_text(json.dumps(done))
    finally:
        ray.shutdown()


def report_slowest(queue: Any, out: dict[str, float], rank: int, size: int) -> None:
    """Rank 0 puts each of `out`'s values at its largest over the ranks (the slower rank's
    step time, the larger peak) on the queue. Needs torch.distributed's default group."""
    import torch.distributed as dist

    every: list[Any] = [None] * size
    dist.all_gather_object(every, out)
    if rank == 0:
        queue.put({k: max(o[k] for o in every) for k in out})


def lm_step(model: Any, optimizer: Any, ids: Any, targets: Any) -> None:
    """One training step of a language model: next-token cross entropy, backward, step."""
    import torch

    optimizer.zero_grad()
    logits = model(ids)
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                      targets.reshape(-1)).backward()
    optimizer.step()


def add_small_gpt_arguments(parser: Any) -> None:
    """The FSDP2 benchmarks' GPT: its size and each rank's batch (8.4 M parameters)."""
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
