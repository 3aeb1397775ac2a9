"""The picture of the Grafana dashboard in docs/metrics.md, made from a real run.

A local Ray cluster (a head and 3 one-CPU worker nodes, each node's metrics agent on its own
port, reporting every second) runs an elastic job with autotune: 3 workers train a small
model; at 40% of the run one worker is killed (its host is blacklisted, 2 train on), at 60%
a fresh node joins (the job grows back to 3). Every node's Prometheus endpoint is scraped
once a second, as Prometheus would, and each panel of the dashboard
(`raytrain_x.ray.grafana.ROWS`) is computed from the scrapes the way its PromQL query
computes it, over a shorter window (the run lasts a minute, not hours). Grafana itself
does not run here; the panels, their metrics and their arithmetic are the dashboard's.

    python tools/metrics_picture.py --seconds 60 --out docs/images/metrics_dashboard.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from raytrain_x.ray.grafana import ROWS, Panel, series_name  # noqa: E402
from raytrain_x.testing.prometheus import Series, scrape_cluster  # noqa: E402

JOB = "picture"


def _train(stop: str) -> int:
    """An MLP on synthetic data, 20 ms of compute a step, elastic, until `stop` exists."""
    import torch

    import raytrain_x.torch as rx

    rx.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters())
    rx.autotune_batch_size(32)
    state = rx.elastic.TorchState(model, opt, step=0)

    def stopping() -> bool:
        flag = torch.tensor([float(os.path.exists(stop))])
        return bool(rx.allreduce(flag, op=rx.Max, name="picture.stop").item())

    @rx.elastic.run
    def train(state):
        while not stopping():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(torch.randn(32, 256)),
                                              torch.randint(0, 10, (32,))).backward()
            opt.step()
            time.sleep(0.02)
            state.step += 1
            if state.step % 5 == 0:
                state.commit()

    train(state)
    return state.step


# ---------------------------------------------------------------- the panels' arithmetic
def _sums(series: list[Series], name: str, by: tuple[str, ...]) -> dict[tuple, float]:
    out: dict[tuple, float] = defaultdict(float)
    for s in series:
        if s.name == name and s.labels.get("job") == JOB:
            out[tuple(s.labels.get(k, "") for k in by)] += s.value
    return out


def _at_or_before(scrapes, t: float):
    best = scrapes[0]
    for scrape in scrapes:
        if scrape[0] <= t:
            best = scrape
    return best


def _quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus's histogram_quantile over cumulative bucket counts (le -> count)."""
    les = sorted(buckets)
    total = buckets[les[-1]] if les else 0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le in les:
        if buckets[le] >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - below) / max(buckets[le] - below, 1e-12)
        lower, below = le, buckets[le]
    return lower


def evaluate(panel: Panel, scrapes: list, window_s: float) -> dict[str, list]:
    """label -> [(t, value)], as the panel's query gives it at each scrape."""
    lines: dict[str, list] = defaultdict(list)
    name = series_name(panel.metric)
    for t, series in scrapes:
        _, earlier = _at_or_before(scrapes, t - window_s)
        span = max(t - _at_or_before(scrapes, t - window_s)[0], 1e-9)
        if panel.how == "quantile":
            now_b = _sums(series, series_name(panel.metric, "bucket"), ("le",))
            old_b = _sums(earlier, series_name(panel.metric, "bucket"), ("le",))
            delta = {float(k[0]): v - old_b.get(k, 0.0) for k, v in now_b.items()}
            value = _quantile(panel.q, delta)
            if value is not None:
                lines["p" + f"{panel.q * 100:g}"].append((t, value))
            continue
        now = _sums(series, name, panel.by)
        if panel.how == "value":
            for key, v in now.items():
                if not panel.only_ones or v == 1:
                    lines[" ".join(key) or JOB].append((t, v))
            continue
        old = _sums(earlier, name, panel.by)
        grown = {k: max(v - old.get(k, 0.0), 0.0) for k, v in now.items()}
        if panel.how == "increase":
            for key, v in grown.items():
                lines[" ".join(key) or JOB].append((t, v))
        elif panel.how == "rate":
            for key, v in grown.items():
                lines[" ".join(key) or JOB].append((t, v / span))
        elif panel.how == "ratio":
            per_now = _sums(series, series_name(panel.per), panel.by)
            per_old = _sums(earlier, series_name(panel.per), panel.by)
            for key, v in grown.items():
                d = per_now.get(key, 0.0) - per_old.get(key, 0.0)
                if d > 0:
                    lines[" ".join(key) or JOB].append((t, v / d))
    return lines


def draw(scrapes: list, marks: dict[str, float], window_s: float, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(row, p) for row, members in ROWS for p in members]
    cols = 4
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(18, 2.6 * rows), squeeze=False)
    t0 = scrapes[0][0]
    for ax, (row, panel) in zip(axes.flat, panels):
        ax.set_xlim(0, scrapes[-1][0] - t0)
        lines = evaluate(panel, scrapes, window_s)
        if not lines:
            ax.text(0.5, 0.5, "no data (nothing counted yet)", ha="center", va="center",
                    transform=ax.transAxes, fontsize=8, color="grey")
        for label, points in sorted(lines.items()):
            if panel.only_ones:
                ax.scatter([t - t0 for t, _ in points], [label] * len(points), s=6)
            else:
                ax.plot([t - t0 for t, _ in points], [v for _, v in points], label=label,
                        lw=1.2)
        for at in marks.values():
            ax.axvline(at - t0, color="grey", ls=":", lw=1)
        ax.set_title(f"{row}: {panel.title}", fontsize=8)
        ax.tick_params(labelsize=7)
        handles, labels = ax.get_legend_handles_labels()
        if 1 < len(labels) <= 8:
            ax.legend(fontsize=6, loc="upper left")
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"raytrain-x dashboard, one elastic job with autotune (seconds; dotted: "
                 f"{', '.join(marks)}); rates over {window_s:g} s", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=90)


# ---------------------------------------------------------------- the run
def run(seconds: float, interval_s: float) -> tuple[list, dict[str, float], dict]:
    import tempfile

    import ray
    from ray.cluster_utils import Cluster

    from raytrain_x.common.autotune_config import AutotuneConfig
    from raytrain_x.ray.executor import RayExecutor
    from raytrain_x.testing.waiting import free_port

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp = tempfile.mkdtemp(prefix="rtxpic", dir="/tmp")
    system = {"metrics_report_interval_ms": int(interval_s * 1000)}
    cluster = Cluster(initialize_head=False, connect=False)
    stop = os.path.join(temp, "stop")
    scrapes: list = []
    marks: dict[str, float] = {}
    done = threading.Event()
    try:
        cluster.add_node(num_cpus=1, include_dashboard=False, temp_dir=temp,
                         metrics_export_port=free_port(), _system_config=system)

        def node() -> None:
            cluster.add_node(num_cpus=1, resources={"picture": 1},
                             metrics_export_port=free_port())

        for _ in range(3):
            node()
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=10), min_workers=1,
                               max_workers=3, cpus_per_worker=1,
                               resources_per_worker={"picture": 1}, name=JOB,
                               autotune=AutotuneConfig(warmup_samples=1, steps_per_sample=20,
                                                       bayes_opt_max_samples=8))
        executor.start(extra_env_vars={"RAYTRAIN_X_METRICS_INTERVAL_S": str(interval_s)})
        result: dict = {}
        job = threading.Thread(target=lambda: result.update(
            steps=executor.run(_train, args=(stop,))), daemon=True)
        start = time.time()
        job.start()

        def scrape() -> None:
            while not done.wait(interval_s):
                scrapes.append((time.time(), scrape_cluster()))
                print(f"  {time.time() - start:5.1f}s scraped {len(scrapes[-1][1])} series",
                      flush=True)

        scraper = threading.Thread(target=scrape, daemon=True)
        scraper.start()
        while time.time() - start < 0.4 * seconds:
            time.sleep(0.2)
        victim = max(executor.last_elastic_job.members.values(), key=lambda m: m.age)
        ray.kill(victim.actor, no_restart=True)
        marks["worker killed"] = time.time()
        while time.time() - start < 0.6 * seconds:
            time.sleep(0.2)
        node()
        marks["node joined"] = time.time()
        while time.time() - start < seconds:
            time.sleep(0.2)
        open(stop, "w").close()
        job.join(120)
        time.sleep(3 * interval_s)  # the last exports
        done.set()
        scraper.join()
        history = executor.elastic_history
        executor.shutdown()
        return scrapes, marks, {"steps": result.get("steps"), "rounds": history}
    finally:
        done.set()
        ray.shutdown()
        cluster.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--interval", type=float, default=1.0,
                        help="seconds between exports and between scrapes")
    parser.add_argument("--window", type=float, default=10.0, help="seconds of each rate")
    parser.add_argument("--out", default="docs/images/metrics_dashboard.png")
    parser.add_argument("--json", help="also write the scrapes here")
    args = parser.parse_args()
    scrapes, marks, record = run(args.seconds, args.interval)
    draw(scrapes, marks, args.window, args.out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"marks": marks, "record": record, "scrapes": [
                (t, [(s.name, s.labels, s.value) for s in series]) for t, series in scrapes]},
                f)
    print(f"{len(scrapes)} scrapes; job: {record['steps']}; rounds: "
          f"{[(r['size'], r['reason']) for r in record['rounds']]}; picture: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
