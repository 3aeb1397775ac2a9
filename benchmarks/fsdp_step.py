"""An FSDP2-sharded GPT (`fully_shard` per block, then the model; AdamW) trained elastic in
memory, against the same model under plain FSDP2 and under DDP, on 2, 3 and 4 processes;
each way in a fresh set of processes (so each peak RSS is its own):

  ddp        DistributedDataParallel with AdamW: every rank holds the whole model (the
             full copy the memory target is a fraction of)
  fsdp_gloo  torch's fully_shard over torch's own gloo group (every pair connected at the
             start), AdamW; no elastic state
  fsdp       the same on the mesh raytrain-x gives (`rx.device_mesh()`: gloo connecting
             pairs as collectives first need them); no elastic state: the baseline
  rx_fsdp    the same model and mesh, inside `rx.elastic.run` with
             `TorchState(model, optimizer, replicas=1)`, a commit every --commit-every steps
             (each rank's chunks copied to host memory and to one peer)
  rx_fsdp_bg the same with `commit_in_background=True`: the copies to the peer travel on
             the engine's thread while training goes on, taken up at the next commit

Each times --steps steps after 3 warmup steps (one commit among them; the slower rank's
seconds), and reads what a rank holds after a step, counted from the tensors themselves:
parameters, gradients and optimizer state (each rank's local rows under FSDP2) and, for
rx_fsdp, its committed copies (its own chunks and the peers' it keeps), and its peak
resident memory. On a GPU the live state and the commits sit in different memories; on
these CPUs both are host memory, so the committed copies are shown apart.

Run: .venv/bin/python benchmarks/fsdp_step.py [--worlds 2 3 4] [--steps 20] [--rounds 3]
    [--ways ddp fsdp_gloo fsdp rx_fsdp rx_fsdp_bg]
Writes results/fsdp_step.json.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torch.distributed as dist

from common import (
    add_small_gpt_arguments,
    join_world,
    print_table,
    report_slowest,
    run_ranks,
    write_json,
)


def _local(tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _live_bytes(model, opt) -> dict[str, int]:
    """Parameters, gradients and optimizer state this rank holds (local rows)."""
    params = [_local(p) for p in model.parameters()]
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    state = [_local(v) for s in opt.state.values() for v in s.values()
             if torch.is_tensor(v) and v.dim() > 0]
    return {name: sum(t.numel() * t.element_size() for t in ts)
            for name, ts in (("param", params), ("grad", grads), ("state", state))}


def _worker(rank: int, size: int, port: int, way: str, args, queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import raytrain_x.torch as rx
    from raytrain_x.torch.workloads import GPTDecoder, synthetic_tokens

    join_world(rank, size, port)
    rx.init()
    model = GPTDecoder(vocab=args.vocab, layers=args.layers, width=args.width, heads=4,
                       seq=args.seq)
    ids, targets = synthetic_tokens(args.batch, seq=args.seq, vocab=args.vocab, seed=rank)
    if way == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
    else:
        mesh = init_device_mesh("cpu", (size,)) if way == "fsdp_gloo" else rx.device_mesh()
        for block in model.blocks.layers:
            fully_shard(block, mesh=mesh)
        net = fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    commits: list[float] = []

    def step() -> None:
        opt.zero_grad()
        logits = net(ids)
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                          targets.reshape(-1)).backward()
        opt.step()

    def timed(state=None) -> dict:
        def one(i: int) -> None:
            step()
            if state is not None and (i + 1) % args.commit_every == 0:
                began = time.perf_counter()
                state.commit()
                commits.append(time.perf_counter() - began)

        for i in range(3):  # warmup; the first commit among it
            one(i + args.commit_every - 2)
        commits.clear()
        dist.barrier()
        began = time.perf_counter()
        for i in range(args.steps):
            one(i)
        seconds = time.perf_counter() - began
        return {"step_s": seconds / args.steps,
                "commit_s": statistics.median(commits) if commits else 0.0}

    if way.startswith("rx_fsdp"):
        state = rx.elastic.TorchState(net, opt, replicas=1,
                                      commit_in_background=way == "rx_fsdp_bg")
        timing = rx.elastic.run(lambda s: timed(s))(state)
        gen = state._shards.taken
        committed = sum(c.numel() * c.element_size() for chunks in gen.held.values()
                        for c in chunks)
    else:
        timing, committed = timed(), 0
    out = {**timing, **{f"{k}_bytes": v for k, v in _live_bytes(net, opt).items()},
           "committed_bytes": committed,
           "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    report_slowest(queue, out, rank, size)
    rx.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--commit-every", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1)
    add_small_gpt_arguments(parser)
    parser.add_argument("--ways", nargs="+",
                        default=["ddp", "fsdp_gloo", "fsdp", "rx_fsdp", "rx_fsdp_bg"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ways = args.ways
    if not {"ddp", "fsdp", "rx_fsdp"} <= set(ways):
        parser.error("--ways needs ddp, fsdp and rx_fsdp (the ratios' baselines)")
    results: dict[str, dict] = {}
    rows, ratios = [], {}
    for world in args.worlds:
        runs: dict[str, list[dict]] = {w: [] for w in ways}
        for r in range(args.rounds):  # interleaved: a drift of the machine touches all
            for way in ways:
                runs[way].append(run_ranks(_worker, world, way, args))
                print(f"world {world} round {r + 1}/{args.rounds} {way}: {runs[way][-1]}",
                      flush=True)
        got = {w: {k: statistics.median(o[k] for o in rs) for k in rs[0]}
               for w, rs in runs.items()}
        results[str(world)] = {"medians": got, "rounds": runs}
        full = sum(got["ddp"][f"{k}_bytes"] for k in ("param", "grad", "state"))
        for way in ways:
            live = sum(got[way][f"{k}_bytes"] for k in ("param", "grad", "state"))
            rows.append({"world": world, "way": way, "step ms": 1000 * got[way]["step_s"],
                         "live MB": live / 2**20,
                         "committed MB": got[way]["committed_bytes"] / 2**20,
                         "peak RSS MB": got[way]["peak_mb"]})
        rx, plain = got["rx_fsdp"], got["fsdp"]
        ratios[str(world)] = {
            "speed_over_fsdp": plain["step_s"] / rx["step_s"],
            "commit_share": rx["commit_s"] / (args.commit_every * rx["step_s"]),
            "live_over_full": sum(rx[f"{k}_bytes"] for k in ("param", "grad", "state")) / full,
            "committed_over_full": rx["committed_bytes"] / full,
            "target_over_full": (1 + 1) / world,
        }
        if "rx_fsdp_bg" in got:
            bg = got["rx_fsdp_bg"]
            ratios[str(world)].update({
                "bg_speed_over_fsdp": plain["step_s"] / bg["step_s"],
                "bg_commit_share": bg["commit_s"] / (args.commit_every * bg["step_s"]),
                "bg_speed_over_rx_fsdp": rx["step_s"] / bg["step_s"]})
    print_table(rows, ["world", "way", "step ms", "live MB", "committed MB", "peak RSS MB"])
    for world, r in ratios.items():
        print(f"world {world}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()))
    payload = {"args": vars(args), "results": results, "ratios": ratios}
    print(f"wrote {write_json('fsdp_step', payload, args.json)}")


if __name__ == "__main__":
    main()
