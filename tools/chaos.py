"""A chaos soak: an elastic job trains while a seeded schedule of faults hits it, and every
invariant is checked mechanically at the end.

Two clusters (--cluster):
  local     a local multi-node Ray cluster (`ray.cluster_utils.Cluster`): a head that runs
            no workers and --nodes (4) worker nodes of 1 CPU each
  emulated  --nodes hosts, each a network namespace running a Ray node, joined by shaped
            1 Gbit/s links (`EmulatedCluster`); host 0 is the head and runs the driver, so
            node faults and partitions hit the other hosts; a lost host starts again as
            a fresh node. Ray checks each node once a second and declares it dead after
            5 failed checks, but each check waits its 10 s deadline, so a cut-off node
            outlives every partition here (the report counts those it let go)

The job runs as its own driver process, as a user's script would:
`RayExecutor(min_workers=2, max_workers=--nodes, cooldown_range=--cooldown)` training the
ledger job (`raytrain_x.testing.jobs.torch_ledger`, or the Keras face's
`raytrain_x.testing.jobs.keras_ledger` with --framework keras), one commit per step, until
the stop file appears (torch) or its planned steps are done (Keras). A job the schedule
stops with a named cause (every worker holding the state killed: ElasticStateLost; too few
workers past elastic_timeout: ElasticTimeout) is followed by a new one. Faults (--kinds;
drawn by the seeded schedule from each job's first committed step on, --mean-gap seconds
apart on average; with chance --burst a fault comes with a second one at once). The
schedule runs --minutes from the first job's first committed step, so a machine slow to
start the cluster gets the same window of faults; with --min-faults N it goes on past
that until N faults were injected (for at most another --minutes, or 2 minutes if longer;
fewer then is an error):

  worker_kill      SIGKILL of a worker process
  node_kill        every process of a node gone at once; a fresh node joins --respawn s later
  drain            the GCS drain a spot notice sends (2 s deadline); the node goes 3 s later
  raylet_kill      SIGKILL of a node's raylet: its workers end themselves once it is gone
                   (Ray would leave them running); the node is removed 5 s later and a
                   fresh node joins --respawn s later
  while_starting   a worker killed while a new worker is still starting
  in_rendezvous    a worker killed while the job re-forms after a fault (its state sync)
  partition_short  (emulated) a host's link down for 3 s, less than the collective timeout
  partition_long   (emulated) a host's link down for the collective timeout plus 4 s
  control_kill     (local, not by default) SIGKILL of the job's rounds or store actor on
                   the head: the driver ends every worker and starts the job again from
                   its latest durable checkpoint
  driver_kill      (local, not by default) SIGKILL of the driver process; the same command
                   runs again --respawn s later and resumes from the latest checkpoint
  discovery_outage (local, not by default) the job's host discovery script fails (exits 3)
                   or hangs, at random, for 4-15 s; the job keeps its hosts meanwhile
  lose_everything  (local, not by default) SIGKILL of every worker at once: the driver starts
                   new ones, which restore the latest durable checkpoint
  storage_outage   (local, --storage s3, not by default) the S3 server stopped for 4-15 s
                   and started again; the job trains on, its writes meanwhile fail and are
                   counted, and a round that must restore waits for storage

With control_kill, driver_kill, lose_everything or storage_outage among --kinds the job
writes a durable checkpoint every second (`CheckpointConfig`) to the run's temp dir, or with
--storage s3 to moto's S3 server, which the soak starts on loopback; a step sequence going
back to a restored checkpoint is then by design. With discovery_outage the job finds its
hosts with a discovery script (`host_discovery_script`) that prints the live worker nodes'
ids, as a cloud API's script would print its instances; a fault then takes the script down.
--slots 2 gives each node two worker slots, so the workers of a node meet in shared memory
(and a node fault takes two at once).

Checked at the end; the run fails (exit 1) when any does not hold:
  every committed step done exactly once on every rank of a finished job (the step
  ledger); each epoch's samples seen once; equal weights on every rank; rank 0's committed
  step never going back more than one step; no fault holding the job longer than the
  collective timeout plus one rendezvous and a node's respawn, counted from the last fault
  of a train and leaving out time below min_workers (a wait for capacity); the driver
  exiting 0 with no unhandled exception; after the cluster stops, no Ray process, no
  shared-memory segment and no network namespace of the run left.
Reported: faults injected and survived, recovery time per kind (from the fault to the first
step committed after it by the re-formed world, or after a short partition's end, or after
a discovery outage began, the job training on with the hosts it has: median,
p95, max, over all faults and over isolated ones), steps and restores, and throughput over
time with the faults marked (a plot).

Run alone: .venv/bin/python tools/chaos.py --seed 1 2 3 --minutes 5
           .venv/bin/python tools/chaos.py --cluster emulated --nodes 3 --seed 4
           .venv/bin/python tools/chaos.py --framework keras --seed 5 --mean-gap 8
Replay a failing schedule with the seed it printed (its timing still depends on the
machine).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from raytrain_x.testing import leaks
from raytrain_x.testing.results import print_table, write_json

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"

LOCAL_KINDS = ("worker_kill", "node_kill", "drain", "raylet_kill", "while_starting",
               "in_rendezvous")
EMULATED_KINDS = ("worker_kill", "partition_short", "partition_long", "raylet_kill",
                  "while_starting", "in_rendezvous")
DURABLE_KINDS = ("control_kill", "driver_kill")  # the job then writes checkpoints
STORAGE_KINDS = ("lose_everything", "storage_outage")  # the same, and storage is hit
SCRIPTED_KINDS = ("discovery_outage",)  # the job then finds its hosts with a script
KINDS = tuple(dict.fromkeys(LOCAL_KINDS + EMULATED_KINDS + DURABLE_KINDS + STORAGE_KINDS
                            + SCRIPTED_KINDS))
DEFAULT_KINDS = tuple(k for k in KINDS
                      if k not in DURABLE_KINDS + STORAGE_KINDS + SCRIPTED_KINDS)
RIDDEN_KINDS = SCRIPTED_KINDS + ("storage_outage",)  # the job trains on through them
CONTROL_ACTORS = ("ray::ElasticRounds", "ray::StoreActor")  # their processes' titles
RESOURCE = "rtx_chaos"
TIMEOUT_S = 10.0  # the job's collective timeout
RENDEZVOUS_S = 10.0  # one rendezvous, a new worker's start included, on this machine
SHORT_PARTITION_S = 3.0
LONG_PARTITION_S = TIMEOUT_S + 4.0
PAUSE_S = 0.05  # each step's sleep
PHASES = ("failure", "drain", "left", "round")  # the driver events a fault's phases time
# Ray's health checks: one a second, a node dead after 5 failures. A check of a cut-off node
# fails only at its deadline (`health_check_timeout_ms`, 10 s by default), so Ray lets such
# a node go after about a minute, and it outlives the partitions here (none of 11 in the
# seed-25 partition run), while a killed raylet's checks are refused at once. A host Ray
# let go starts again as a fresh node (so does a killed one).
NODE_DEAD_S = 5
EMULATED_RAY_CONFIG = {"health_check_period_ms": 1000,
                       "health_check_failure_threshold": NODE_DEAD_S,
                       "gcs_rpc_server_reconnect_timeout_s": 120,
                       "gcs_grpc_initial_reconnect_backoff_ms": 100,
                       "gcs_grpc_max_reconnect_backoff_ms": 1000}


# ----------------------------------------------------------------------------- the driver
class Monitor(threading.Thread):
    """In the driver: samples rank 0's progress and the job's round every 20 ms as
    (t, step, size, round), and keeps the status file ("rounds starting") current for the
    fault injector."""

    def __init__(self, progress: str, status: str, executor: Any) -> None:
        super().__init__(daemon=True)
        self.progress, self.status, self.executor = progress, status, executor
        self.samples: list[tuple[float, int, int, int]] = []
        self.below: list[tuple[float, bool]] = []  # (t, fewer than min_workers from then)
        self.restores: list[float] = []  # when a round restoring from storage was seen
        self.stop = threading.Event()
        self.error: str | None = None  # what stopped it early (the soak then fails)

    def run(self) -> None:
        try:
            self._sample()
        except Exception as exc:  # noqa: BLE001 - reported by the driver
            self.error = f"{type(exc).__name__}: {exc}"

    def _sample(self) -> None:
        from raytrain_x.testing.jobs.ledger import read_progress

        last = None
        seen, offset, restored = None, 0, 0  # a job started again numbers rounds from 1
        while not self.stop.wait(0.02):
            job = self.executor.last_elastic_job
            if job is not seen:
                offset += seen.rounds if seen is not None else 0
                seen, restored = job, 0
            rounds = offset + (job.rounds if job is not None else 0)
            if job is not None:
                now_restored = sum(1 for e in job.history if e.get("restored_from"))
                if now_restored > restored:
                    restored = now_restored
                    self.restores.append(time.monotonic())
            starting = len(job.pending) if job is not None else 0
            if job is not None:
                below = len(job.staying()) < job.settings.min_workers
                if not self.below or self.below[-1][1] != below:
                    self.below.append((time.monotonic(), below))
            if (rounds, starting) != last:
                last = (rounds, starting)
                tmp = f"{self.status}.tmp"
                Path(tmp).write_text(f"{rounds} {starting}")
                os.replace(tmp, self.status)
            step, size = read_progress(self.progress)
            if step and (not self.samples or self.samples[-1][1:] != (step, size, rounds)):
                self.samples.append((time.monotonic(), step, size, rounds))


def drive(args: argparse.Namespace) -> int:
    """The job's driver process: an elastic job on the cluster at RAY_ADDRESS; writes what
    the ranks returned, the progress samples, the round history and any error to --out."""
    import logging

    import ray

    from raytrain_x.ray import RayExecutor

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    ray.init(log_to_driver=False)
    out: dict = {}
    from raytrain_x import CheckpointConfig

    checkpoint = (CheckpointConfig(args.checkpoint, name="chaos", every_s=1.0)
                  if args.checkpoint else None)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=TIMEOUT_S), min_workers=2,
                           max_workers=args.nodes * args.slots, cpus_per_worker=1,
                           resources_per_worker={RESOURCE: 1} if args.resource else None,
                           cooldown_range=tuple(args.cooldown), elastic_timeout=120,
                           checkpoint=checkpoint,
                           host_discovery_script=args.discovery or None)
    monitor = Monitor(args.progress, args.status, executor)
    try:
        env = {"TF_CPP_MIN_LOG_LEVEL": "3", "OMP_NUM_THREADS": "1"}
        executor.start(extra_env_vars=env)
        monitor.start()
        if args.framework == "keras":
            from raytrain_x.testing.jobs.keras_ledger import keras_ledger_train

            out["ranks"] = executor.run(keras_ledger_train, args=(args.steps // 2, PAUSE_S),
                                        kwargs={"progress": args.progress})
        else:
            from raytrain_x.testing.jobs.torch_ledger import ledger_train

            out["ranks"] = executor.run(ledger_train, args=(None, PAUSE_S),
                                        kwargs={"stop": args.stop, "progress": args.progress})
    except BaseException as exc:  # noqa: BLE001 - reported; the injector judges it
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        monitor.stop.set()
        out["samples"] = monitor.samples
        out["monitor_error"] = monitor.error
        out["below"] = monitor.below
        out["restores_seen"] = monitor.restores
        out["history"] = executor.elastic_history
        job = executor.last_elastic_job
        # the driver's events (monotonic time: one clock with the injector's) show where a
        # recovery spent its time: the drain noticed, the workers gone, the round formed
        out["events"] = [(e.time, e.kind) for e in job.log.events] if job is not None else []
        executor.shutdown()
        ray.shutdown()
        Path(args.out).write_text(json.dumps(out, default=str))
    return 0


# ----------------------------------------------------------------------------- clusters
class LocalNodes:
    """A local multi-node cluster (`ray.cluster_utils.Cluster`); hosts are its worker
    nodes."""

    kinds = LOCAL_KINDS

    def __init__(self, nodes: int, temp: str, slots: int = 1) -> None:
        from ray._common.utils import get_ray_address_file
        from ray.cluster_utils import Cluster

        self.slots = slots
        # Ray writes the head's address to /tmp/ray whatever the head's temp_dir; on a
        # machine where no Ray ran yet that folder does not exist
        Path(get_ray_address_file(None)).parent.mkdir(parents=True, exist_ok=True)
        self.cluster = Cluster(initialize_head=True, connect=False, head_node_args={
            "num_cpus": 0, "include_dashboard": False, "temp_dir": temp})
        for _ in range(nodes):
            self.add()
        self.cluster.wait_for_nodes()
        self.address = self.cluster.address

    def add(self) -> None:
        self.cluster.add_node(num_cpus=self.slots, resources={RESOURCE: self.slots})

    def control_pids(self) -> list[int]:
        """The processes of the job's rounds and store actors (on the head)."""
        from raytrain_x.testing.processes import processes

        return sorted(p for p, (_, cmd) in processes().items()
                      if cmd.startswith(CONTROL_ACTORS))

    def hosts(self) -> list[Any]:
        return list(self.cluster.worker_nodes)

    def node_hosts(self) -> list[Any]:
        return self.hosts()

    def name(self, host: Any) -> str:
        return host.node_id[:8]

    def raylet(self, host: Any) -> int | None:
        procs = host.all_processes.get("raylet") or []
        return procs[0].process.pid if procs else None

    def worker_pids(self, host: Any) -> list[int]:
        from raytrain_x.testing.processes import processes, with_descendants

        raylet = self.raylet(host)
        if raylet is None:
            return []
        procs = processes()
        return sorted(p for p in with_descendants({raylet}, procs)
                      if procs.get(p, (0, ""))[1].startswith("ray::WorkerActor"))

    def node_kill(self, host: Any) -> None:
        self.cluster.remove_node(host, allow_graceful=False)

    def raylet_kill(self, host: Any) -> None:
        os.kill(self.raylet(host), signal.SIGKILL)

    def remove(self, host: Any) -> None:
        if host in self.cluster.worker_nodes:
            self.cluster.remove_node(host, allow_graceful=False)

    def drain(self, host: Any) -> None:
        from raytrain_x.testing.autoscaling import drain_node

        drain_node(self.address, host.node_id, deadline_s=2.0)

    def driver(self, cmd: list[str], log) -> subprocess.Popen:
        return subprocess.Popen(cmd, env={**os.environ, "RAY_ADDRESS": self.address},
                                stdout=log, stderr=subprocess.STDOUT)

    def shutdown(self) -> None:
        self.cluster.shutdown()


class EmulatedNodes:
    """An emulated multi-host cluster (`EmulatedCluster`); hosts are indices, host 0 the
    head, which runs the driver and takes no node faults."""

    kinds = EMULATED_KINDS

    def __init__(self, nodes: int, temp: str) -> None:
        from raytrain_x.testing import EmulatedCluster

        self.cluster = EmulatedCluster(hosts=nodes, workers_per_host=1, link_gbit=1.0,
                                       system_config=EMULATED_RAY_CONFIG).start()
        self.address = self.cluster.address
        self.down: set[int] = set()  # hosts whose node was killed, until restarted

    def hosts(self) -> list[int]:
        return [h for h in range(self.cluster.hosts) if h not in self.down]

    def node_hosts(self) -> list[int]:
        return [h for h in self.hosts() if h != 0]

    def name(self, host: int) -> str:
        return f"host{host}"

    def worker_pids(self, host: int) -> list[int]:
        from raytrain_x.testing.cluster import namespace_pids
        from raytrain_x.testing.processes import processes

        procs = processes()
        return sorted(p for p in namespace_pids(self.cluster.namespace(host))
                      if procs.get(p, (0, ""))[1].startswith("ray::WorkerActor"))

    def raylet_kill(self, host: int) -> None:
        self.cluster.stop_host(host)  # the raylet and every worker of the host
        self.down.add(host)

    node_kill = raylet_kill

    def remove(self, host: int) -> None:
        pass

    def add_host(self, host: int) -> bool:
        """Starts `host` again as a fresh node unless its raylet still runs (a host back
        from a partition the node survived); whether it did."""
        fresh = self.cluster.raylet_pid(host) is None
        if fresh:
            self.cluster.stop_host(host)  # workers the lost raylet left behind
            self.cluster.start_node(host)
        self.down.discard(host)
        return fresh

    def link(self, host: int, up: bool) -> None:
        (self.cluster.link_up if up else self.cluster.link_down)(host)

    def driver(self, cmd: list[str], log) -> subprocess.Popen:
        return self.cluster.popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def shutdown(self) -> None:
        self.cluster.shutdown()


# ----------------------------------------------------------------------------- faults
class Window:
    """When the schedule stops: `seconds` after the first committed step, and later while
    fewer than `min_faults` faults were injected (up to `cap_s` more)."""

    def __init__(self, seconds: float, min_faults: int) -> None:
        self.seconds, self.min_faults = seconds, min_faults
        self.cap_s = max(seconds, 120.0) if min_faults else 0.0
        self.began: float | None = None  # the first committed step

    def start(self, now: float) -> None:
        if self.began is None:
            self.began = now

    def left(self, now: float) -> float:
        """Seconds of the planned window left (all of it before the first commit)."""
        return self.seconds if self.began is None else self.began + self.seconds - now

    def over(self, now: float, faults: int) -> bool:
        if self.began is None:
            return False
        end = self.began + self.seconds
        return now >= end and (faults >= self.min_faults or now >= end + self.cap_s)


class S3Server:
    """moto's S3 server on loopback, in this process, that the job checkpoints to; stopped
    and started again on the same port by `storage_outage` (what it holds stays: moto keeps
    its buckets in this process)."""

    KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}

    def __init__(self) -> None:
        import logging

        from raytrain_x.testing.waiting import free_port

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's line per request
        self.port = free_port()
        os.environ.update(self.KEYS)  # the driver and the cluster's workers inherit them
        self._server: Any = None
        self.start()

    @property
    def up(self) -> bool:
        return self._server is not None

    def uri(self, bucket: str) -> str:
        return (f"s3://{bucket}/runs?endpoint_override=127.0.0.1:{self.port}&scheme=http"
                "&allow_bucket_creation=true")

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        if self._server is None:
            self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port,
                                              verbose=False)
            self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


class DiscoveryScript:
    """The job's host discovery script (with discovery_outage): it prints the hosts file
    that the injector keeps current (`<node id>:<slots>` for each worker node the cluster
    has), and while the down file exists it fails (exit 3) or hangs until the file is
    gone, as the file says."""

    def __init__(self, temp: str, nodes: LocalNodes) -> None:
        folder = Path(temp)
        self.path = folder / "discover.sh"
        self.hosts, self.down = folder / "hosts", folder / "discovery_down"
        self.nodes = nodes
        self._written: str | None = None
        self.path.write_text(
            "#!/bin/sh\n"
            f"if [ -e {self.down} ]; then\n"
            f"  if [ \"$(cat {self.down} 2>/dev/null)\" = fail ]; then\n"
            "    echo 'the cloud API is unavailable' >&2; exit 3\n"
            "  fi\n"
            f"  while [ -e {self.down} ]; do sleep 0.2; done\n"
            "fi\n"
            f"cat {self.hosts}\n")
        self.path.chmod(0o755)
        self.refresh()

    def refresh(self) -> None:
        """Writes the hosts file when the cluster's worker nodes changed."""
        text = "".join(f"{host.node_id}:{self.nodes.slots}\n" for host in self.nodes.hosts())
        if text != self._written:
            _replace(self.hosts, text)
            self._written = text

    def is_down(self) -> bool:
        return self.down.exists()

    def take_down(self, mode: str) -> None:
        _replace(self.down, mode)

    def bring_up(self) -> None:
        self.down.unlink(missing_ok=True)


def _replace(path: Path, text: str) -> None:
    """Writes `path` whole at once: a reader sees the old text or the new one."""
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    partial.replace(path)


class Chaos:
    """Injects the seeded schedule's faults and carries out the delayed parts (node
    removals, fresh nodes, links back up, discovery back) when they are due."""

    def __init__(self, nodes: Any, rng: random.Random, respawn_s: float,
                 discovery: DiscoveryScript | None = None,
                 storage: S3Server | None = None) -> None:
        self.nodes, self.rng, self.respawn_s = nodes, rng, respawn_s
        self.discovery = discovery
        self.storage = storage
        self.log: list[dict] = []
        self.due: list[tuple[float, str, Any]] = []  # (when, action, host)
        self.driver: subprocess.Popen | None = None  # the job's driver process
        self.driver_killed = False

    def _with_workers(self, hosts: list[Any]) -> list[Any]:
        busy = [host for _, action, host in self.due if action != "add"]  # going, cut off
        return [h for h in hosts if h not in busy and self.nodes.worker_pids(h)]

    def fault(self, kind: str) -> bool:
        """Injects one fault; False when nothing it applies to exists right now."""
        nodes = self.nodes
        if kind in DURABLE_KINDS:
            return self._durable_fault(kind)
        if kind in SCRIPTED_KINDS:
            return self._discovery_outage(kind)
        if kind in STORAGE_KINDS:
            return self._storage_fault(kind)
        node_kind = kind not in ("worker_kill", "while_starting", "in_rendezvous")
        hosts = self._with_workers(nodes.node_hosts() if node_kind else nodes.hosts())
        if not hosts:
            return False
        host = self.rng.choice(hosts)
        t = time.monotonic()
        end = t
        if not node_kind:
            pids = nodes.worker_pids(host)
            if not pids:
                return False
            try:
                os.kill(self.rng.choice(pids), signal.SIGKILL)
            except ProcessLookupError:
                return False
        elif kind == "node_kill":
            nodes.node_kill(host)
            self.due.append((t + self.respawn_s, "add", host))
        elif kind == "raylet_kill":
            nodes.raylet_kill(host)
            # Ray declares the node dead after its health checks (16 s); its workers are gone
            # by then (`exit_with_raylet`), the rest of its processes go here
            self.due.append((t + 5.0, "remove", host))
            self.due.append((t + max(self.respawn_s, 5.0), "add", host))
        elif kind == "drain":
            nodes.drain(host)
            self.due.append((t + 3.0, "remove", host))
            self.due.append((t + self.respawn_s, "add", host))
        elif kind.startswith("partition"):
            nodes.link(host, up=False)
            end = t + (SHORT_PARTITION_S if kind == "partition_short" else LONG_PARTITION_S)
            self.due.append((end, "link_up", host))
            self.due.append((end + 3.0, "add", host))  # a fresh node, if Ray let it go
        self.log.append({"kind": kind, "t": t, "end": end, "host": nodes.name(host)})
        return True

    def _durable_fault(self, kind: str) -> bool:
        """A kill of the rounds or store actor, or of the driver process."""
        t = time.monotonic()
        if kind == "control_kill":
            pids = self.nodes.control_pids()
            if not pids:
                return False
            try:
                os.kill(self.rng.choice(pids), signal.SIGKILL)
            except ProcessLookupError:
                return False
        else:
            if self.driver is None or self.driver.poll() is not None:
                return False
            self.driver.kill()
            self.driver_killed = True
        self.log.append({"kind": kind, "t": t, "end": t, "host": "head"})
        return True

    def _storage_fault(self, kind: str) -> bool:
        """Every worker killed at once, or the S3 server stopped for 4-15 s."""
        t = time.monotonic()
        end = t
        if kind == "lose_everything":
            pids = [p for h in self.nodes.hosts() for p in self.nodes.worker_pids(h)]
            if not pids:
                return False
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            where = f"{len(pids)} workers"
        else:
            if self.storage is None or not self.storage.up:
                return False
            end = t + self.rng.uniform(4.0, 15.0)
            self.storage.stop()
            self.due.append((end, "storage_up", None))
            where = "s3"
        self.log.append({"kind": kind, "t": t, "end": end, "host": where})
        return True

    def _discovery_outage(self, kind: str) -> bool:
        """The discovery script failing or hanging for 4-15 s."""
        if self.discovery is None or self.discovery.is_down():
            return False
        t = time.monotonic()
        end = t + self.rng.uniform(4.0, 15.0)
        mode = self.rng.choice(["fail", "hang"])
        self.discovery.take_down(mode)
        self.due.append((end, "discovery_up", None))
        self.log.append({"kind": kind, "t": t, "end": end, "host": mode})
        return True

    def tick(self, final: bool = False) -> None:
        """Carries out what is due (everything, when `final`)."""
        if self.discovery is not None:
            self.discovery.refresh()
        now = time.monotonic()
        for entry in sorted((d for d in self.due if final or d[0] <= now), key=lambda d: d[0]):
            self.due.remove(entry)
            _, action, host = entry
            if action == "remove":
                self.nodes.remove(host)
            elif action == "link_up":
                self.nodes.link(host, up=True)
            elif action == "discovery_up":
                self.discovery.bring_up()
            elif action == "storage_up":
                self.storage.start()
            elif action == "add" and not final:
                if hasattr(self.nodes, "add_host"):
                    fresh = self.nodes.add_host(host)
                    partitions = [f for f in self.log if f["kind"].startswith("partition")
                                  and f["host"] == self.nodes.name(host)]
                    if partitions and "node_lost" not in partitions[-1]:
                        # did Ray declare the cut-off node dead (its raylet exited)?
                        partitions[-1]["node_lost"] = fresh
                else:
                    self.nodes.add()


def _status(path: Path) -> tuple[int, int]:
    try:
        rounds, starting = map(int, path.read_text().split())
        return rounds, starting
    except (OSError, ValueError):
        return 0, 0


# a job may stop with these, by design (the driver killed by the schedule, too)
NAMED_STOPS = ("ElasticStateLost", "ElasticTimeout", "ControlActorLost", "driver killed")


def soak(seed: int, minutes: float, cluster: str, nodes: int, framework: str,
         kinds: list[str], mean_gap: float, burst: float, respawn_s: float,
         cooldown: tuple[float, float], out_dir: Path = RESULTS_DIR,
         bound_scale: float = 1.0, min_faults: int = 0, slots: int = 1,
         storage: str = "local") -> dict:
    """One seed's run: a cluster and the schedule for `minutes` from the first committed
    step (longer while fewer than `min_faults` faults were injected), against one job after
    another: a job the schedule stops with a named cause (it killed every worker holding
    the state, or left fewer than min_workers past elastic_timeout) is followed by a new
    one. Returns what it saw."""
    rng = random.Random(seed)
    before = leaks.snapshot()
    temp = tempfile.mkdtemp(prefix="rtxchaos", dir="/tmp")
    out: dict = {"seed": seed, "cluster": cluster, "framework": framework, "faults": [],
                 "errors": [], "jobs": [], "progress": [], "steps": 0, "restores": 0}
    began = time.monotonic()
    kinds = [k for k in kinds if k in (LOCAL_KINDS + DURABLE_KINDS + STORAGE_KINDS
                                       + SCRIPTED_KINDS
                                       if cluster == "local" else EMULATED_KINDS)]
    durable = set(kinds) & set(DURABLE_KINDS + STORAGE_KINDS)
    s3 = S3Server() if durable and storage == "s3" else None  # before the cluster: its keys
    if s3 is None:
        kinds = [k for k in kinds if k != "storage_outage"]
    world = LocalNodes(nodes, temp, slots) if cluster == "local" else \
        EmulatedNodes(nodes, temp)
    checkpoint = "" if not durable else s3.uri(f"chaos{seed}") if s3 is not None else \
        str(Path(temp) / "checkpoints")
    out["storage"] = "s3" if s3 is not None else "local" if durable else None
    namespaces = getattr(world.cluster, "_created", [])[:]
    discovery = DiscoveryScript(temp, world) if set(kinds) & set(SCRIPTED_KINDS) else None
    chaos = Chaos(world, rng, respawn_s, discovery, s3)
    window = Window(minutes * 60, min_faults)
    logs = []
    try:
        # a new job only where the window leaves it time to start and commit (20 s)
        while not out["jobs"] or not window.over(time.monotonic() + 20, len(chaos.log)):
            if out["jobs"] and out["jobs"][-1]["outcome"] == "driver killed":
                time.sleep(respawn_s)  # the same command, run again
            job = _job(len(out["jobs"]), world, chaos, rng, temp, framework, nodes, kinds,
                       mean_gap, burst, cooldown, window, slots, checkpoint,
                       str(discovery.path) if discovery else "")
            job["faults"] = _judge(job, chaos.log[job["first_fault"]:], began, respawn_s,
                                   bound_scale)
            out["jobs"].append({k: v for k, v in job.items() if k not in ("faults", "ranks")})
            out["faults"] += job["faults"]
            out["errors"] += [f"job {job['index']}: {e}" for e in job["errors"]]
            out["progress"] += job["progress"]
            out["steps"] += job["steps"]
            out["restores"] += job["restores"]
            logs.append(job["log"])
            print(f"chaos: seed {seed} job {job['index']}: {job['outcome']}, "
                  f"{len(job['faults'])} faults, {job['steps']} steps", flush=True)
            if job["outcome"] not in NAMED_STOPS or window.began is None:
                break  # a failed job, or one that stopped before any step (no schedule ran)
        out["seconds"] = time.monotonic() - began
        out["window_began"] = None if window.began is None else window.began - began
        if len(chaos.log) < min_faults:
            out["errors"].append(f"{len(chaos.log)} faults injected, fewer than the "
                                 f"{min_faults} asked for: the job did not get far enough "
                                 f"to take them")
    finally:
        chaos.tick(final=True)
        world.shutdown()
        if s3 is not None:
            s3.stop()
    out_dir.mkdir(parents=True, exist_ok=True)
    kept = out_dir / f"chaos_{cluster}_{framework}_seed{seed}.log"
    kept.write_text("\n".join(Path(p).read_text() for p in logs if Path(p).exists()))
    out["log"] = str(kept)
    if out["errors"]:  # the workers' own logs, for whoever looks into it
        out["worker_logs"] = _keep_worker_logs(temp, kept.with_suffix(""))
    out["errors"] += _leftovers(before, temp, namespaces)
    return out


def _keep_worker_logs(temp: str, dest: Path) -> str:
    """Copies the Ray workers' logs of the run's sessions into `dest` (a failed run's
    temp dir is removed like any other's)."""
    import shutil

    for log in Path(temp).glob("**/logs/worker-*"):
        target = dest / log.parent.parent.name / log.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, target)
    return str(dest)


def _job(index: int, world: Any, chaos: Chaos, rng: random.Random, temp: str,
         framework: str, nodes: int, kinds: list[str], mean_gap: float, burst: float,
         cooldown: tuple[float, float], window: Window, slots: int = 1,
         checkpoint: str = "", discovery: str = "") -> dict:
    """One job's driver under the schedule until it exits; what it returned."""
    from raytrain_x.testing.jobs.ledger import ledger_errors, read_progress

    files = {n: str(Path(temp) / f"{n}{index}")
             for n in ("progress", "status", "stop", "out", "log")}
    steps = int(window.left(time.monotonic()) / (PAUSE_S + 0.1)) // 2 * 2  # Keras: 2 epochs
    job: dict = {"index": index, "errors": [], "first_fault": len(chaos.log),
                 "log": files["log"], "began": time.monotonic()}
    cmd = [sys.executable, __file__, "drive", "--framework", framework,
           "--nodes", str(nodes), "--slots", str(slots), "--steps", str(steps),
           "--cooldown", *map(str, cooldown),
           *(["--resource"] if isinstance(world, LocalNodes) else []),
           *([f"--checkpoint={checkpoint}"] if checkpoint else []),
           *([f"--discovery={discovery}"] if discovery else []),
           *[f"--{n}={files[n]}" for n in ("progress", "status", "stop", "out")]]
    with open(files["log"], "w") as log:
        driver = world.driver(cmd, log)
    chaos.driver, chaos.driver_killed = driver, False
    try:
        # the schedule starts once the job committed its first step, however long its start
        # took on this machine: faults before it would test starting, not recovering
        next_at, last_round = None, 0
        while driver.poll() is None:
            time.sleep(0.05)
            chaos.tick()
            now = time.monotonic()
            if window.over(now, len(chaos.log)):
                Path(files["stop"]).touch()
                continue
            if next_at is None:
                if read_progress(files["progress"])[0] > 0:
                    window.start(now)
                    next_at = now + rng.expovariate(1 / mean_gap)
                continue
            rounds, starting = _status(Path(files["status"]))
            if now < next_at or rounds == 0:
                continue
            kind = rng.choice(kinds)
            if kind == "while_starting" and not starting:
                continue  # wait for a worker to be starting
            if kind == "in_rendezvous" and rounds == last_round:
                continue  # wait for the job to re-form
            last_round = rounds
            if chaos.fault(kind) and rng.random() < burst:  # a second fault at once
                chaos.fault(rng.choice(["worker_kill", *[k for k in kinds
                                                         if k in ("node_kill",
                                                                  "partition_short")]]))
            next_at = now + rng.expovariate(1 / mean_gap)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    job["ended"] = time.monotonic()
    job["driver_exit"] = driver.returncode
    result = json.loads(Path(files["out"]).read_text()) if Path(files["out"]).exists() else {}
    error = result.get("error", "")
    job["outcome"] = "finished" if "ranks" in result else (
        error.split(":", 1)[0] if error else "no result")
    if chaos.driver_killed:
        job["outcome"] = "driver killed"
    elif driver.returncode != 0 or not result:
        job["errors"].append(f"the driver exited {driver.returncode}: {_tail(files['log'])}")
    if error and job["outcome"] not in NAMED_STOPS:
        job["errors"].append(f"the job failed: {error}")
    if result.get("monitor_error"):
        job["errors"].append(f"the driver's monitor stopped: {result['monitor_error']}")
    job["samples"] = result.get("samples", [])
    job["below"] = result.get("below", [])
    job["restores_seen"] = result.get("restores_seen", [])
    ranks = result.get("ranks") or []
    if job["outcome"] == "finished":
        job["errors"] += ledger_errors(ranks, steps if framework == "keras" else None)
    job["steps"] = ranks[0]["step"] if ranks else max([s[1] for s in job["samples"]],
                                                      default=0)
    job["restores"] = sum(r.get("restores", 0) for r in ranks)
    job["history"] = result.get("history", [])
    job["events"] = result.get("events", [])
    return job


def _judge(job: dict, injected: list[dict], began: float, respawn_s: float,
           bound_scale: float = 1.0) -> list[dict]:
    """Each of the job's faults with its recovery time (times from `began`); the faults
    that held the job too long and committed steps lost go to the job's errors."""
    samples, errors = job["samples"], job["errors"]
    bound = (TIMEOUT_S + respawn_s + RENDEZVOUS_S) * bound_scale
    if job["outcome"] == "driver killed" and not samples:
        # its monitor went with it: the next job's ledger judges the resume
        job["progress"] = []
        return [{**f, "job": job["index"], "recovery_s": None, "hold_s": 0.0,
                 "phases": {}, "t": f["t"] - began, "end": f["end"] - began}
                for f in injected]
    faults = []
    for fault in injected:
        f = {**fault, "job": job["index"]}
        step_at = max([s for t, s, _, _ in samples if t <= f["t"]], default=0)
        round_at = max([r for t, _, _, r in samples if t <= f["t"]], default=0)
        # a short partition is ridden out: recovered at the first step after its link
        # returns; a discovery outage too, at the first step after it began (the job
        # trains on with the hosts it has); any other fault, a long partition included,
        # at the first step of the world re-formed after it (which need not wait for a
        # cut-off host's link)
        short = f["kind"] == "partition_short"
        ridden = short or f["kind"] in RIDDEN_KINDS
        after = [t for t, s, _, r in samples
                 if t > (f["end"] if short else f["t"]) and s > step_at
                 and (ridden or r > round_at)]
        f["recovery_s"] = after[0] - f["t"] if after else None
        # where the recovery went: seconds from the fault to the driver's first event of
        # each kind after it (the log is in time order)
        f["phases"] = {}
        for t, kind in job["events"]:
            if t >= f["t"] and kind in PHASES and kind not in f["phases"]:
                f["phases"][kind] = round(t - f["t"], 3)
        # the job cannot recover while faults keep coming: the hold counts from the end of
        # the last fault injected before it recovered (this one, or a later one of a train)
        until = after[0] if after else job["ended"]
        last = max(g["end"] for g in injected if f["t"] <= g["t"] <= until)
        # time with fewer than min_workers is spent waiting for capacity (bounded by
        # elastic_timeout), not held up by the fault
        hold = until - last - _below_between(job["below"], last, until)
        f["hold_s"] = hold
        if hold > bound:
            errors.append(f"the {f['kind']} at {f['t'] - began:.1f}s held the job "
                          f"{hold:.1f}s after the last fault before "
                          f"{'it recovered' if after else 'the job ended'}, time below "
                          f"min_workers aside (bound {bound:.0f}s)")
        f["t"] -= began
        f["end"] -= began
        faults.append(f)
    # a hang that later faults land in is hidden from the count above (it starts again at
    # each one): every stretch without a commit is also checked on its own, less the time
    # faults and the lack of capacity explain
    for (t0, *_), (t1, *_) in zip(samples, samples[1:]):
        stalled = _longest_unexplained(t0, t1, injected, job["below"])
        if stalled > bound:
            errors.append(f"no commit from {t0 - began:.1f}s to {t1 - began:.1f}s: "
                          f"{stalled:.1f}s of it with no fault under way and enough workers "
                          f"(bound {bound:.0f}s)")
    # rank 0 writes each step it committed: after a restore it writes that step again (or
    # the one before, where a peer died between two ranks' commits), never less
    restores = job.get("restores_seen", [])
    for (t0, a, _, _), (t1, b, _, _) in zip(samples, samples[1:]):
        # a restore from storage goes back to its checkpoint (the monitor sees the
        # restoring round within its 20 ms samples of either step; 2 s of slack)
        if b < a - 1 and not any(t0 - 2.0 < t <= t1 + 2.0 for t in restores):
            errors.append(f"committed steps lost at {t1 - began:.1f}s: the job went back "
                          f"from step {a} to {b}")
    job["progress"] = [(t - began, s, n) for t, s, n, _ in samples]
    return faults


def _longest_unexplained(start: float, end: float, injected: list[dict],
                         below: list) -> float:
    """The longest part of [start, end] in which no fault was under way and the job had
    min_workers: how long it stood still with nothing to wait for."""
    covered = [(f["t"], f["end"]) for f in injected if f["t"] < end and f["end"] > start]
    covered += [(t0, t1) for t0, t1 in _below_spans(below, end) if t0 < end and t1 > start]
    longest, at = 0.0, start
    for c0, c1 in sorted(covered):
        longest = max(longest, c0 - at)
        at = max(at, c1)
    return max(longest, end - at)


def _below_spans(below: list, end: float) -> list[tuple[float, float]]:
    """The spans with fewer than min_workers, from the (time, is_below) changes in
    `below`; one still open at `end` closes there."""
    return [(t0, t1) for (t0, is_below), (t1, _) in zip(below, [*below[1:], (end, False)])
            if is_below]


def _below_between(below: list, start: float, end: float) -> float:
    """Seconds within [start, end] that the job had fewer than min_workers."""
    return sum(max(0.0, min(t1, end) - max(t0, start)) for t0, t1 in _below_spans(below, end))


def _tail(path: str, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _leftovers(before: leaks.Snapshot, temp: str, namespaces: list[str]) -> list[str]:
    """Processes of this run's cluster, engine shared-memory segments and network
    namespaces left once it stopped."""
    import shutil

    found = leaks.wait_until_clean(before, marker=temp, namespaces=namespaces)
    shutil.rmtree(temp, ignore_errors=True)
    return [f"left behind ({kind}): {item}" for kind, items in found.items() for item in items
            if kind != "temp dirs"]


# ----------------------------------------------------------------------------- report
def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _isolated(fault: dict, faults: list[dict]) -> bool:
    """The job had recovered from every earlier fault of its run (and none came in the
    10 s before), and no other fault came until it recovered."""
    if fault["recovery_s"] is None:
        return False
    until = fault["t"] + fault["recovery_s"]
    for g in faults:
        if g is fault:
            continue
        if fault["t"] - 10 <= g["t"] <= until:
            return False
        if g["t"] < fault["t"] and (g["recovery_s"] is None
                                    or g["t"] + g["recovery_s"] > fault["t"]):
            return False
    return True


def report(runs: list[dict]) -> list[dict]:
    faults = [f for r in runs for f in r["faults"]]
    for r in runs:
        for f in r["faults"]:
            f["isolated"] = _isolated(f, r["faults"])
    rows = []
    for kind in sorted({f["kind"] for f in faults}):
        mine = [f for f in faults if f["kind"] == kind]
        times = [f["recovery_s"] for f in mine if f["recovery_s"] is not None]
        alone = [f["recovery_s"] for f in mine if f["recovery_s"] is not None and f["isolated"]]
        rows.append({"kind": kind, "injected": len(mine), "recovered": len(times),
                     "median s": statistics.median(times) if times else "",
                     "p95 s": _percentile(times, 0.95) if times else "",
                     "max s": max(times) if times else "",
                     "isolated": len(alone),
                     "isolated median s": statistics.median(alone) if alone else "",
                     "isolated p95 s": _percentile(alone, 0.95) if alone else ""})
    print_table(rows, ["kind", "injected", "recovered", "median s", "p95 s", "max s",
                       "isolated", "isolated median s", "isolated p95 s"])
    cut_off = [f for f in faults if "node_lost" in f]
    if cut_off:
        print(f"partitions: Ray declared the cut-off node dead in "
              f"{sum(f['node_lost'] for f in cut_off)} of {len(cut_off)} "
              f"({', '.join(sorted({f['kind'] for f in cut_off}))})")
    minutes = sum(r["seconds"] for r in runs) / 60
    jobs = [j for r in runs for j in r["jobs"]]
    stopped = sum(j["outcome"] != "finished" for j in jobs)
    print(f"{len(faults)} faults in {len(runs)} runs, {minutes:.1f} min; {len(jobs)} jobs "
          f"({stopped} stopped with a named cause); {sum(r['steps'] for r in runs)} steps "
          f"committed, {sum(r['restores'] for r in runs)} restores by the ranks that "
          "finished")
    return rows


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.6 * len(runs)), squeeze=False)
    colors = dict(zip(KINDS, ["tab:red", "tab:purple", "tab:green", "tab:brown",
                              "tab:orange", "tab:pink", "tab:cyan", "tab:blue", "tab:olive",
                              "gold", "tab:gray", "navy", "magenta"]))
    for ax, run in zip(axes[:, 0], runs):
        pts = run["progress"]
        rate = [(pts[i][0], (pts[i][1] - pts[i - 1][1]) / max(pts[i][0] - pts[i - 1][0], 1e-3))
                for i in range(1, len(pts)) if pts[i][1] > pts[i - 1][1]]
        if rate:  # steps/s over 1 s windows
            t0 = [t for t, _ in rate]
            smooth = [sum(v for t, v in rate if tt - 1 < t <= tt) /
                      max(1, sum(1 for t, _ in rate if tt - 1 < t <= tt)) for tt in t0]
            ax.plot(t0, smooth, lw=0.6, color="black")
        for f in run["faults"]:
            ax.axvline(f["t"], color=colors.get(f["kind"], "grey"), lw=0.8, alpha=0.7)
            if f["end"] > f["t"] + 0.5:  # an outage or a partition: how long it lasted
                ax.axvspan(f["t"], f["end"], color=colors.get(f["kind"], "grey"), alpha=0.12)
        ax.set_ylabel("steps/s")
        ax.set_title(f"{run['cluster']} cluster, {run['framework']}, seed {run['seed']}: "
                     f"{len(run['faults'])} faults", fontsize=9)
    axes[-1, 0].set_xlabel("seconds")
    used = {f["kind"] for r in runs for f in r["faults"]}
    handles = [plt.Line2D([], [], color=c, label=k) for k, c in colors.items() if k in used]
    axes[0, 0].legend(handles=handles, fontsize=7, ncol=3, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, nargs="+", default=[1])
    parser.add_argument("--minutes", type=float, default=3.0,
                        help="per seed, from the first committed step")
    parser.add_argument("--min-faults", type=int, default=0,
                        help="go on past --minutes until this many faults were injected")
    parser.add_argument("--cluster", choices=["local", "emulated"], default="local")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--framework", choices=["torch", "keras"], default="torch")
    parser.add_argument("--kinds", nargs="+", default=list(DEFAULT_KINDS), choices=KINDS)
    parser.add_argument("--slots", type=int, default=1,
                        help="worker slots per node (2: a node's workers share memory)")
    parser.add_argument("--mean-gap", type=float, default=6.0, help="seconds between faults")
    parser.add_argument("--burst", type=float, default=0.2,
                        help="the chance that a fault comes with a second one at once")
    parser.add_argument("--respawn", type=float, default=3.0,
                        help="seconds until a lost node is replaced")
    parser.add_argument("--cooldown", type=float, nargs=2, default=[1.0, 8.0],
                        metavar=("LO", "HI"), help="the job's cooldown_range")
    parser.add_argument("--bound-scale", type=float, default=1.0,
                        help="scales the recovery bound (a slower machine)")
    parser.add_argument("--storage", choices=["local", "s3"], default="local",
                        help="where the job checkpoints with durable or storage kinds: the "
                        "run's temp dir, or moto's S3 server on loopback")
    parser.add_argument("--json", default=None, help="where the results go (and the log)")
    args = parser.parse_args()
    runs = []
    for seed in args.seed:
        print(f"chaos: seed {seed} ({args.minutes:g} min, {args.cluster} cluster of "
              f"{args.nodes} nodes, {args.framework})", flush=True)
        out_dir = Path(args.json).parent if args.json else RESULTS_DIR
        run = soak(seed, args.minutes, args.cluster, args.nodes, args.framework, args.kinds,
                   args.mean_gap, args.burst, args.respawn, tuple(args.cooldown), out_dir,
                   args.bound_scale, args.min_faults, args.slots, args.storage)
        runs.append(run)
        verdict = "ok" if not run["errors"] else "FAILED: " + "; ".join(run["errors"])
        print(f"chaos: seed {seed}: {len(run['faults'])} faults in {run['seconds']:.0f}s, "
              f"{verdict}", flush=True)
    rows = report(runs)
    path = write_json(args.json or RESULTS_DIR / f"chaos_{args.cluster}_{args.framework}.json",
                      {"runs": runs, "rows": rows})
    plot(runs, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    failed = [r["seed"] for r in runs if r["errors"]]
    if failed:
        print(f"chaos: seeds {failed} broke an invariant; replay with --seed {failed[0]}")
    return 1 if failed else 0


def drive_main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["drive"])
    for name in ("progress", "status", "stop", "out"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--framework", default="torch")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--slots", type=int, default=1)
    parser.add_argument("--checkpoint", default="")
    parser.add_argument("--discovery", default="")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--cooldown", type=float, nargs=2, required=True)
    parser.add_argument("--resource", action="store_true")
    return drive(parser.parse_args())


if __name__ == "__main__":
    if sys.argv[1:2] == ["drive"]:
        sys.exit(drive_main())
    RESULTS_DIR.mkdir(exist_ok=True)
    sys.exit(main())
