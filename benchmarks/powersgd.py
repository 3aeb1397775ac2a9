"""PowerSGD across a slow link: raytrain-x's reducer against DDP with torch's PowerSGD hook.

Two emulated hosts (network namespaces with a Ray node each, `tc tbf` at --link-gbit each
way), one worker per host, one thread each. In the same two worker processes, round after
round, each way trains its own copy of the same GPT-style decoder (AdamW, the same batches)
for --steps timed steps:

  ddp            torch's DistributedDataParallel, no compression (what compression saves)
  ddp-powersgd   DDP with torch's `powerSGD_hook` (PowerSGDState: the same rank, start
                 iteration, error feedback and warm start)
  rx-powersgd    raytrain-x's DistributedOptimizer(reducer=rx.PowerSGD(...))

The first --warmup steps of each way (uncompressed, both: start_iter) are not timed.
Reports each way's steps/s (the median over rounds of the slower rank's rate), the ratio
rx-powersgd / ddp-powersgd (the target: >= 1.0), each way's held-out loss after its last
step, and writes results/powersgd.json and results/powersgd.png.

Run alone, as root (it makes namespaces): .venv/bin/python benchmarks/powersgd.py
    [--link-gbit 1] [--rank 4] [--rounds 5] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from common import (
    RESULTS_DIR,
    drive_worlds,
    emulated_world,
    lm_step,
    print_table,
    run_emulated,
    say,
    write_json,
)

WAYS = ("ddp", "ddp-powersgd", "rx-powersgd")


def _measure(cfg: dict) -> dict:
    """In each worker: every way's step times, round by round, and its held-out loss."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    import raytrain_x.torch as rx
    from raytrain_x.torch.workloads import GPTDecoder, markov_tokens

    torch.set_flush_denormal(True)
    rank = rx.rank()

    def batch(step: int):
        return markov_tokens(cfg["batch"], seq=cfg["seq"], vocab=cfg["vocab"],
                             seed=1000 * step + rank)

    def model():
        torch.manual_seed(0)
        return GPTDecoder(vocab=cfg["vocab"], layers=cfg["layers"], width=cfg["width"],
                          heads=4, seq=cfg["seq"])

    steppers = {}
    for way in WAYS:
        if way.startswith("ddp"):
            module = model()
            ddp = torch.nn.parallel.DistributedDataParallel(module)
            if way == "ddp-powersgd":
                state = psgd.PowerSGDState(
                    process_group=None, matrix_approximation_rank=cfg["rank"],
                    start_powerSGD_iter=cfg["warmup"], min_compression_rate=2,
                    use_error_feedback=True, warm_start=True)
                ddp.register_comm_hook(state, psgd.powerSGD_hook)
            opt = torch.optim.AdamW(ddp.parameters(), lr=cfg["lr"])
            steppers[way] = (ddp, opt, module)
        else:
            module = model()
            opt = rx.DistributedOptimizer(
                torch.optim.AdamW(module.parameters(), lr=cfg["lr"]),
                named_parameters=module.named_parameters(),
                reducer=rx.PowerSGD(matrix_rank=cfg["rank"], start_iter=cfg["warmup"]))
            steppers[way] = (module, opt, module)
    done = dict.fromkeys(WAYS, 0)

    def run(way: str, steps: int) -> float:
        net, opt, _ = steppers[way]
        dist.barrier()
        began = time.perf_counter()
        for _ in range(steps):
            lm_step(net, opt, *batch(done[way]))
            done[way] += 1
        dist.barrier()
        return steps / (time.perf_counter() - began)

    for way in WAYS:
        run(way, cfg["warmup"])
    rates: dict[str, list[float]] = {way: [] for way in WAYS}
    for r in range(cfg["rounds"]):
        for way in WAYS:
            rates[way].append(run(way, cfg["steps"]))
        if rank == 0:
            say(f"round {r + 1}/{cfg['rounds']}: " + ", ".join(
                f"{w} {rates[w][-1]:.2f} steps/s" for w in WAYS))
    held_out = [markov_tokens(16, seq=cfg["seq"], vocab=cfg["vocab"], seed=10**6 + i)
                for i in range(2)]
    losses = {}
    with torch.no_grad():
        for way, (_, _, module) in steppers.items():
            losses[way] = sum(torch.nn.functional.cross_entropy(
                module(x).flatten(0, 1), y.flatten()).item() for x, y in held_out) / 2
    sent, whole = steppers["rx-powersgd"][1].reducer.bytes_sent()
    every = rx.allgather_object(rates, name="powersgd_rates")
    slower = {way: [min(r[way][i] for r in every) for i in range(cfg["rounds"])]
              for way in WAYS}
    return {"steps_per_s": slower, "loss": losses, "bytes_sent": sent, "bytes_whole": whole,
            "steps": done}


def _worker(cfg: dict) -> dict:
    return emulated_world(lambda: _measure(cfg))


def _plot(raw: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = raw["results"]["steps_per_s"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    meds = [statistics.median(rates[w]) for w in WAYS]
    ax.bar(WAYS, meds, color=["#999", "#4c72b0", "#dd8452"])
    for i, way in enumerate(WAYS):
        ax.plot([i] * len(rates[way]), rates[way], "k.", alpha=0.5)
    cfg = raw["config"]
    ax.set_ylabel("steps/s (slower rank)")
    ax.set_title(f"GPT, 2 hosts over {cfg['link_gbit']:g} Gbit/s, PowerSGD rank {cfg['rank']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-gbit", type=float, default=1.0)
    parser.add_argument("--rank", type=int, default=4, help="the approximation's rank")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per way and round")
    parser.add_argument("--warmup", type=int, default=5,
                        help="untimed uncompressed first steps (start_iter)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--inside", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    cfg = {k: getattr(args, k) for k in ("rank", "rounds", "steps", "warmup", "vocab",
                                         "layers", "width", "seq", "batch", "lr",
                                         "link_gbit")}
    if args.inside:
        drive_worlds(2, [1], args.inside, lambda ex: ex.run(_worker, args=[cfg])[0])
        return
    began = time.monotonic()
    raw = run_emulated(__file__, sys.argv[1:], hosts=2, workers_per_host=1,
                       link_gbit=args.link_gbit)["1"]
    raw["config"] = cfg
    got = raw["results"]
    med = {w: statistics.median(got["steps_per_s"][w]) for w in WAYS}
    rows = [{"way": w, "steps/s": med[w], "min": min(got["steps_per_s"][w]),
             "max": max(got["steps_per_s"][w]), "vs ddp-powersgd": med[w] / med["ddp-powersgd"],
             "held-out loss": got["loss"][w]} for w in WAYS]
    print(f"transport {raw['transport']}; rx-powersgd sends {got['bytes_sent'] / 2**20:.2f} MB "
          f"a step of {got['bytes_whole'] / 2**20:.1f} MB of gradients")
    print_table(rows, ["way", "steps/s", "min", "max", "vs ddp-powersgd", "held-out loss"])
    raw["rows"] = rows
    raw["seconds"] = round(time.monotonic() - began, 1)
    path = write_json("powersgd", raw)
    _plot(raw, RESULTS_DIR / "powersgd.png")
    print(f"wrote {path} and {RESULTS_DIR / 'powersgd.png'} ({raw['seconds']:.0f}s)")


if __name__ == "__main__":
    main()
