"""A chaos soak: an elastic job trains while a seeded schedule of faults hits it, and every
invariant is checked mechanically at the end.

The cluster: a local multi-node Ray cluster (`ray.cluster_utils.Cluster`: a head that runs
no workers, --nodes worker nodes of 1 CPU each); the job: `RayExecutor(min_workers=2,
max_workers=--nodes)` training a small torch model with `rx.elastic.run` and an
`ElasticSampler`, one commit per step. Faults (--kinds; each drawn by the seeded schedule,
--mean-gap seconds apart on average, sometimes in bursts):

  worker_kill      SIGKILL of a worker process
  node_kill        every process of a node gone at once (Cluster.remove_node, ungraceful);
                   a fresh node joins --respawn seconds later
  drain            the GCS drain a spot notice sends (2 s deadline); the node is removed
                   once its worker left, and a fresh node joins
  raylet_kill      SIGKILL of a node's raylet: Ray declares the node dead; a fresh node joins
  while_starting   a worker killed while a new worker is still starting
  in_rendezvous    a worker killed while the job re-forms after a fault

Checked at the end, and the run fails (exit 1) when any does not hold:
  every committed step done exactly once on every surviving rank (the step ledger); equal
  weights on every rank; each epoch's samples seen once; the job finished; no fault left
  the job stuck longer than the collective timeout plus one rendezvous; the driver raised
  nothing; after the cluster stops, no Ray process and no shared-memory segment is left.
Reported: faults injected and survived, recovery time per kind (from the fault to the
first step committed by the re-formed world: median, p95, max), steps redone, and
throughput over time with the faults marked (a plot).

Run alone: .venv/bin/python benchmarks/chaos.py --seed 1 --minutes 3
Replay a failing schedule with the seed it printed.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, print_table, write_json  # noqa: E402

KINDS = ("worker_kill", "node_kill", "drain", "raylet_kill", "while_starting",
         "in_rendezvous")
RESOURCE = "rtx_chaos"
SAMPLES = 64
TIMEOUT_S = 10.0  # the job's collective timeout
RENDEZVOUS_S = 10.0  # one rendezvous, a new worker's start included, on this machine


def _train(steps: int, pause: float, progress: str) -> dict:
    """The elastic training function: a step ledger in the committed state."""
    import torch

    import raytrain_x.torch as rx

    rx.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters())
    sampler = rx.elastic.ElasticSampler(range(SAMPLES), seed=1)
    state = rx.elastic.TorchState(model, opt, sampler=sampler, step=0, ledger=[], epoch=0,
                                  seen={0: []})

    @rx.elastic.run
    def train(state):
        batches = enumerate(state.sampler)
        while state.step < steps:
            batch = next(batches, None)
            if batch is None:
                state.epoch += 1
                state.sampler.set_epoch(state.epoch)
                state.seen[state.epoch] = []
                batches = enumerate(state.sampler)
                batch = next(batches)
            batch_idx, index = batch
            position = batch_idx * state.sampler.num_replicas + state.sampler.rank
            padding = position >= len(state.sampler.remaining_indices)
            opt.zero_grad()
            model(torch.full((4, 8), float(index))).sum().backward()
            opt.step()
            everyone = rx.allgather_object([] if padding else [index])
            state.seen[state.epoch].extend(i for part in everyone for i in part)
            state.sampler.record_batch(batch_idx, 1)
            state.ledger.append(state.step)
            state.step += 1
            time.sleep(pause)
            state.commit()
            if rx.rank() == 0:
                tmp = f"{progress}.{os.getpid()}"
                with open(tmp, "w") as f:
                    f.write(f"{state.step} {rx.size()}")
                os.replace(tmp, progress)
        return {"step": state.step, "ledger": list(state.ledger), "rank": rx.rank(),
                "seen": dict(state.seen), "weight": model.weight.detach().flatten().tolist()}

    return train(state)


class Monitor(threading.Thread):
    """Samples rank 0's progress and the job's round every 20 ms: (t, step, size, round)."""

    def __init__(self, progress: Path, executor) -> None:
        super().__init__(daemon=True)
        self.progress, self.executor = progress, executor
        self.samples: list[tuple[float, int, int, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            try:
                step, size = map(int, self.progress.read_text().split())
            except (OSError, ValueError):
                continue
            job = self.executor.last_elastic_job
            rounds = job.rounds if job is not None else 0
            if not self.samples or self.samples[-1][1:] != (step, size, rounds):
                self.samples.append((time.monotonic(), step, size, rounds))

    def at(self, t: float) -> tuple[int, int]:
        """(step, round) last seen at time t."""
        seen = [s for s in self.samples if s[0] <= t]
        return (seen[-1][1], seen[-1][3]) if seen else (0, 0)

    def recovered(self, t: float) -> float | None:
        """Seconds from t to the first step committed in a later round than at t."""
        step, rounds = self.at(t)
        for when, s, _, r in self.samples:
            if when > t and r > rounds and s > step:
                return when - t
        return None


class Chaos:
    """Injects the seeded schedule's faults into the cluster, from the main thread (a
    `Cluster` is changed only there)."""

    def __init__(self, cluster, executor, rng: random.Random, respawn_s: float) -> None:
        self.cluster, self.executor, self.rng = cluster, executor, rng
        self.respawn_s = respawn_s
        self.log: list[dict] = []
        self.to_add: list[float] = []  # when to add a fresh node
        self.removals: list[tuple[float, object]] = []  # when to take a node out

    def add_node(self) -> None:
        self.cluster.add_node(num_cpus=1, resources={RESOURCE: 1})

    def _members(self) -> list:
        job = self.executor.last_elastic_job
        return list(job.members.values()) if job is not None else []

    def _node(self, node_id: str):
        return next((n for n in self.cluster.worker_nodes if n.node_id == node_id), None)

    def fault(self, kind: str) -> bool:
        """Injects one fault; False when the job has nothing it applies to right now."""
        import ray

        members = [m for m in self._members() if not m.leaving]
        if not members:
            return False
        victim = self.rng.choice(members)
        t = time.monotonic()
        if kind in ("worker_kill", "while_starting", "in_rendezvous"):
            try:
                os.kill(ray.get(victim.actor.pid.remote(), timeout=2), signal.SIGKILL)
            except Exception:  # noqa: BLE001 - it died already: nothing injected
                return False
        elif kind == "node_kill":
            node = self._node(victim.node)
            if node is None:
                return False
            self.cluster.remove_node(node, allow_graceful=False)
            self.to_add.append(t + self.respawn_s)
        elif kind == "raylet_kill":
            node = self._node(victim.node)
            if node is None:
                return False
            os.kill(node.all_processes["raylet"][0].process.pid, signal.SIGKILL)
            self.removals.append((t + 5.0, node))  # Ray finds the node dead by itself first
            self.to_add.append(t + self.respawn_s)
        elif kind == "drain":
            from raytrain_x.testing.autoscaling import drain_node

            node = self._node(victim.node)
            if node is None:
                return False
            drain_node(self.cluster.address, victim.node, deadline_s=2.0)
            self.removals.append((t + 3.0, node))
            self.to_add.append(t + self.respawn_s)
        self.log.append({"kind": kind, "t": t, "node": victim.node[:8]})
        return True

    def tick(self) -> None:
        """Carries out the node removals and additions that are due."""
        now = time.monotonic()
        for entry in [r for r in self.removals if r[0] <= now]:
            self.removals.remove(entry)
            if entry[1] in self.cluster.worker_nodes:
                self.cluster.remove_node(entry[1], allow_graceful=False)
        for when in [w for w in self.to_add if w <= now]:
            self.to_add.remove(when)
            self.add_node()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def soak(seed: int, minutes: float, nodes: int, kinds: list[str], mean_gap: float,
         respawn_s: float) -> dict:
    """One run: a cluster, an elastic job, the schedule; returns what it saw."""
    import ray
    from ray.cluster_utils import Cluster

    from raytrain_x.ray import RayExecutor

    rng = random.Random(seed)
    pause = 0.05
    steps = int(minutes * 60 / (pause + 0.05))  # about --minutes on this machine
    temp = tempfile.mkdtemp(prefix="rtxchaos", dir="/tmp")
    progress = Path(temp) / "progress"
    cluster = Cluster(initialize_head=True, connect=True, head_node_args={
        "num_cpus": 2, "include_dashboard": False, "temp_dir": temp})
    began = time.monotonic()
    out: dict = {"seed": seed, "steps": steps, "faults": [], "errors": []}
    executor = None
    try:
        for _ in range(nodes):
            cluster.add_node(num_cpus=1, resources={RESOURCE: 1})
        cluster.wait_for_nodes()
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=TIMEOUT_S),
                               min_workers=2, max_workers=nodes, cpus_per_worker=1,
                               resources_per_worker={RESOURCE: 1}, elastic_timeout=120)
        executor.start()
        result: dict = {}

        def run() -> None:
            try:
                result["ranks"] = executor.run(_train, args=(steps, pause, str(progress)))
            except BaseException as exc:  # noqa: BLE001 - a driver crash is a finding
                result["error"] = exc

        job = threading.Thread(target=run, daemon=True)
        job.start()
        monitor = Monitor(progress, executor)
        monitor.start()
        chaos = Chaos(cluster, executor, rng, respawn_s)
        next_at = time.monotonic() + 5 + rng.expovariate(1 / mean_gap)
        last_round = 0
        while job.is_alive():
            time.sleep(0.05)
            chaos.tick()
            now = time.monotonic()
            live = executor.last_elastic_job
            rounds = live.rounds if live is not None else 0
            if now < next_at:
                continue
            kind = rng.choice(kinds)
            if kind == "while_starting" and (live is None or not live.pool.pending):
                continue  # wait for a worker to be starting
            if kind == "in_rendezvous" and rounds == last_round:
                continue  # wait for the job to re-form
            last_round = rounds
            if chaos.fault(kind) and rng.random() < 0.2:  # a burst: a second fault at once
                chaos.fault(rng.choice(["worker_kill", "node_kill"]))
            next_at = now + rng.expovariate(1 / mean_gap)
        monitor.stop.set()
        monitor.join()
        out["seconds"] = time.monotonic() - began
        if "error" in result:
            out["errors"].append(f"the driver raised {result['error']!r}")
        for entry in chaos.log:
            entry["recovery_s"] = monitor.recovered(entry["t"])
            entry["t"] -= began
        out["faults"] = chaos.log
        bound = TIMEOUT_S + respawn_s + RENDEZVOUS_S
        for entry in chaos.log:
            if entry["recovery_s"] is None and entry["t"] < out["seconds"] - bound:
                out["errors"].append(f"no step after the {entry['kind']} at "
                                     f"{entry['t']:.1f}s")
            elif entry["recovery_s"] is not None and entry["recovery_s"] > bound:
                out["errors"].append(f"the {entry['kind']} at {entry['t']:.1f}s held the job "
                                     f"{entry['recovery_s']:.1f}s (bound {bound:.0f}s)")
        out["progress"] = [(t - began, s, n) for t, s, n, _ in monitor.samples]
        out["errors"] += _check(result.get("ranks") or [], steps)
        out["history"] = executor.elastic_history
    finally:
        if executor is not None:
            executor.shutdown()
        ray.shutdown()
        cluster.shutdown()
    out["errors"] += _leftovers(temp)
    return out


def _check(ranks: list[dict], steps: int) -> list[str]:
    """The invariants over what the surviving ranks returned; each broken one is a line."""
    if not ranks:
        return ["no rank finished"]
    errors = []
    for r in ranks:
        if r["ledger"] != list(range(steps)):
            lost = sorted(set(range(steps)) - set(r["ledger"]))
            doubled = sorted({s for s in r["ledger"] if r["ledger"].count(s) > 1})
            errors.append(f"rank {r['rank']}: steps lost {lost[:10]}, doubled {doubled[:10]}")
        *finished, current = [r["seen"][e] for e in sorted(r["seen"])]
        for epoch, seen in enumerate(finished):
            if sorted(seen) != list(range(SAMPLES)):
                errors.append(f"rank {r['rank']}: epoch {epoch} did not see each sample once")
        if len(set(current)) != len(current):
            errors.append(f"rank {r['rank']}: a sample twice in the epoch under way")
    if any(r["weight"] != ranks[0]["weight"] for r in ranks):
        errors.append("the ranks' weights differ")
    return errors


def _leftovers(temp: str) -> list[str]:
    """Ray processes of this run's cluster and engine shared-memory segments left."""
    import shutil

    from raytrain_x.common.procs import processes

    deadline = time.monotonic() + 30
    while True:
        procs = [f"{p}: {c[:100]}" for p, (_, c) in processes().items() if temp in c]
        shm = [n for n in os.listdir("/dev/shm") if n.startswith("rtx-")]
        if not (procs or shm) or time.monotonic() > deadline:
            break
        time.sleep(1)
    shutil.rmtree(temp, ignore_errors=True)
    return ([f"left running: {p}" for p in procs] +
            [f"left in /dev/shm: {n}" for n in shm])


def report(runs: list[dict]) -> list[dict]:
    faults = [f for r in runs for f in r["faults"]]
    rows = []
    for kind in sorted({f["kind"] for f in faults}):
        times = [f["recovery_s"] for f in faults if f["kind"] == kind
                 and f["recovery_s"] is not None]
        rows.append({"kind": kind, "injected": sum(f["kind"] == kind for f in faults),
                     "recovered": len(times),
                     "median s": statistics.median(times) if times else "",
                     "p95 s": _percentile(times, 0.95) if times else "",
                     "max s": max(times) if times else ""})
    print_table(rows, ["kind", "injected", "recovered", "median s", "p95 s", "max s"])
    return rows


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.6 * len(runs)), squeeze=False)
    colors = dict(zip(KINDS, ["tab:red", "tab:purple", "tab:green", "tab:brown",
                              "tab:orange", "tab:pink"]))
    for ax, run in zip(axes[:, 0], runs):
        pts = run["progress"]
        rate = [(pts[i][0], (pts[i][1] - pts[i - 1][1]) / max(pts[i][0] - pts[i - 1][0], 1e-3))
                for i in range(1, len(pts)) if pts[i][1] > pts[i - 1][1]]
        if rate:
            ax.plot([t for t, _ in rate], [v for _, v in rate], lw=0.6, color="black")
        for f in run["faults"]:
            ax.axvline(f["t"], color=colors.get(f["kind"], "grey"), lw=0.8, alpha=0.7)
        ax.set_ylabel("steps/s")
        ax.set_title(f"seed {run['seed']}: {len(run['faults'])} faults", fontsize=9)
    axes[-1, 0].set_xlabel("seconds")
    handles = [plt.Line2D([], [], color=c, label=k) for k, c in colors.items()]
    axes[0, 0].legend(handles=handles, fontsize=7, ncol=3, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, nargs="+", default=[1])
    parser.add_argument("--minutes", type=float, default=3.0, help="per seed")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--mean-gap", type=float, default=4.0, help="seconds between faults")
    parser.add_argument("--respawn", type=float, default=3.0,
                        help="seconds until a lost node is replaced")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    runs = []
    for seed in args.seed:
        print(f"chaos: seed {seed} ({args.minutes:g} min, {args.nodes} nodes, kinds "
              f"{','.join(args.kinds)})", flush=True)
        run = soak(seed, args.minutes, args.nodes, args.kinds, args.mean_gap, args.respawn)
        runs.append(run)
        verdict = "ok" if not run["errors"] else "FAILED: " + "; ".join(run["errors"])
        print(f"chaos: seed {seed}: {len(run['faults'])} faults in {run['seconds']:.0f}s, "
              f"{verdict}", flush=True)
    rows = report(runs)
    path = write_json("chaos", {"runs": runs, "rows": rows}, args.json)
    plot(runs, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    failed = [r["seed"] for r in runs if r["errors"]]
    if failed:
        print(f"chaos: seeds {failed} broke an invariant; replay with --seed {failed[0]}")
    return 1 if failed else 0


if __name__ == "__main__":
    RESULTS_DIR.mkdir(exist_ok=True)
    sys.exit(main())
