"""Elastic training that grows and drains with the Ray autoscaler.

The job starts with what the cluster has (at least `--min-workers`), asks the autoscaler
for room for `--max-workers`, and takes each new node's worker in at the next commit. When
Ray drains a node (autoscaler scale-down, `ray drain-node`, a spot preemption notice), that
node's workers leave at the next commit: nothing is restored or trained twice. Every round
prints one line (size, hosts, why), and the run ends with the round history.

On one machine, with Ray's fake multi-node provider (each node a real raylet here):

    python examples/elastic_autoscaling.py --local

On an autoscaling cluster (examples/clusters/aws-spot.yaml):

    ray job submit --working-dir . -- python examples/elastic_autoscaling.py \\
        --min-workers 2 --max-workers 8 --cpus-per-worker 4 --use-gpu

Try a spot notice while it runs: `ray drain-node --address auto --node-id NODE
--reason DRAIN_NODE_REASON_PREEMPTION --reason-message spot --deadline-remaining-seconds 60`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def train(steps: int, step_pause_s: float, until_file: str | None,
          progress_file: str | None = None) -> dict:
    """One worker: the digits MLP, a commit after every step. It trains `steps` steps, or
    with `until_file` until that file exists (rank 0 looks; every rank stops at the same
    step). With `progress_file`, rank 0 rewrites it after every commit with the step and
    the world size. Returns what it committed, for checking that no step was lost or done
    twice."""
    import torch

    sys.path.insert(0, HERE)
    from torch_digits import load_shard

    import raytrain_x.torch as rx

    rx.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    (x, y), _ = load_shard(0, 1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                  named_parameters=model.named_parameters())
    state = rx.elastic.TorchState(model, opt, step=0, done_steps=[], sizes=[])

    @rx.elastic.run
    def loop(state):
        while state.step < steps:
            if until_file is not None and rx.broadcast_object(
                    rx.rank() == 0 and os.path.exists(until_file), 0, name="until_file"):
                break
            shard = slice(rx.rank() + (state.step * 32 * rx.size()) % len(x), None, rx.size())
            xb, yb = x[shard][:32], y[shard][:32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            state.done_steps.append(state.step)
            state.sizes.append(rx.size())
            state.step += 1
            time.sleep(step_pause_s)
            state.commit()
            if progress_file is not None and rx.rank() == 0:
                with open(progress_file + ".tmp", "w") as f:
                    f.write(f"{state.step} {rx.size()} {rx.elastic.restore_count()}\n")
                os.replace(progress_file + ".tmp", progress_file)
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        return {"rank": rx.rank(), "size": rx.size(), "steps": state.step,
                "done_steps": list(state.done_steps), "sizes": list(state.sizes),
                "weights_sum": float(weights.double().sum()),
                "weights_equal_check": [float(v) for v in weights[:8]],
                "restores": rx.elastic.restore_count()}

    return loop(state)


def summarize(results: list[dict]) -> dict:
    """What the committed history says: every step once, every rank the same weights."""
    first = results[0]
    return {
        "workers_finished": len(results),
        "steps": first["steps"],
        "each_step_once": all(r["done_steps"] == list(range(r["steps"])) for r in results),
        "weights_equal": all(r["weights_equal_check"] == first["weights_equal_check"]
                             and r["weights_sum"] == first["weights_sum"] for r in results),
        "restores": sum(r["restores"] for r in results),
        "sizes_seen": sorted(set(first["sizes"])),
    }


def plot(history: list[dict], path: str) -> None:
    """World size over time, one step per round, labelled with its reason."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 3))
    times = [h["time_s"] for h in history]
    sizes = [h["size"] for h in history]
    ax.step(times, sizes, where="post")
    for h in history:
        ax.annotate(h["reason"], (h["time_s"], h["size"]), fontsize=7, rotation=30)
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel("workers")
    ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_title("elastic job: world size per round")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", help="Ray cluster (default: RAY_ADDRESS or a new one)")
    parser.add_argument("--local", action="store_true",
                        help="start a local autoscaling cluster (examples/clusters/"
                             "local-fake.yaml) for the job, and stop it after")
    parser.add_argument("--min-workers", type=int, default=1)
    parser.add_argument("--max-workers", type=int, default=4)
    parser.add_argument("--cpus-per-worker", type=float, default=1)
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--step-pause", type=float, default=0.05,
                        help="seconds each step sleeps (the local nodes start in seconds; "
                             "this keeps the job running while they do)")
    parser.add_argument("--until-file", help="train until this file exists (ignores "
                                             "--steps)")
    parser.add_argument("--elastic-timeout", type=float, default=120)
    parser.add_argument("--cooldown", type=float, nargs=2, default=(10, 60),
                        metavar=("LO", "HI"), help="blacklist cooldown range, seconds")
    parser.add_argument("--progress", help="rank 0 rewrites this file after every commit "
                                           "with `step world_size restores`")
    parser.add_argument("--json", help="write the history and per-rank results here")
    parser.add_argument("--plot", help="write a plot of the world size over time here")
    args = parser.parse_args()

    import ray

    from raytrain_x import RaytrainXError
    from raytrain_x.ray import RayExecutor

    cluster = None
    if args.local:
        from raytrain_x.testing import LocalAutoscalingCluster

        # each node up 3 s after its launch, as a cloud instance takes a while to boot:
        # the job starts small and grows while it trains
        cluster = LocalAutoscalingCluster(
            config_file=os.path.join(HERE, "clusters", "local-fake.yaml"),
            node_launch_delay_s=3).start()
        args.address = cluster.address
        print(f"local autoscaling cluster at {cluster.address}", flush=True)
    try:
        ray.init(address=args.address, runtime_env={"env_vars": {"PYTHONPATH": HERE}},
                 log_to_driver=False)
        executor = None
        try:
            executor = RayExecutor(RayExecutor.create_settings(timeout_s=30),
                                   min_workers=args.min_workers, max_workers=args.max_workers,
                                   cpus_per_worker=args.cpus_per_worker, use_gpu=args.use_gpu,
                                   elastic_timeout=args.elastic_timeout,
                                   cooldown_range=tuple(args.cooldown))
            executor.start()
            steps = 1 << 30 if args.until_file else args.steps
            results = executor.run(train, args=(steps, args.step_pause, args.until_file,
                                                args.progress))
        except RaytrainXError as exc:  # a clear message, not a traceback
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        finally:
            history = executor.elastic_history if executor is not None else []
            if executor is not None:
                executor.shutdown()
        summary = summarize(results)
        print("round history:")
        for h in history:
            print(f"  round {h['round']:>2} at {h['time_s']:6.1f}s: {h['size']} workers on "
                  f"{h['hosts']} hosts, {h['reason']} (joined {h['joined']}, left "
                  f"{h['left']}, failed {h['failed']}; asked the autoscaler for "
                  f"{h['requested']})")
        print(f"summary: {json.dumps(summary)}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"history": history, "results": results, "summary": summary}, f,
                          indent=1)
        if args.plot:
            plot(history, args.plot)
        return 0 if summary["each_step_once"] and summary["weights_equal"] else 1
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
