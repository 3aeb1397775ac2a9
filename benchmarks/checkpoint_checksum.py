"""What the manifest's checksums cost a checkpoint write: the GPT workload's state (its
model and AdamW state after a step) written as a durable checkpoint's part by torch DCP's
file system writer (every file fsynced), three ways in one process, alternating which goes
first over --rounds rounds:

- plain: no checksum (the baseline);
- reread: the files read back and hashed (xxh3-128) once written;
- streamed: each file hashed as its bytes are written (what raytrain-x does).

Reported: the median seconds and throughput (MB/s) of each way, and each way's throughput
as a ratio to plain. Writes results/checkpoint_checksum_cpu.json.

Run: .venv/bin/python benchmarks/checkpoint_checksum.py [--layers 8 --width 512 --rounds 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from common import lm_step, print_table, write_json

WAYS = ("plain", "reread", "streamed")


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)


def main() -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from raytrain_x.elastic.checksums import file_checksum
    from raytrain_x.torch.durable import dcp_payload, hashing_writer
    from raytrain_x.torch.workloads import GPTDecoder, synthetic_tokens

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPTDecoder(layers=args.layers, width=args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids, targets = synthetic_tokens(4, seed=0)
    lm_step(model, opt, ids, targets)
    payload = dcp_payload({"model": model.state_dict(), "optimizer": opt.state_dict()})

    def write(way: str, folder: str) -> dict[str, str]:
        if way == "streamed":
            writer, streams = hashing_writer(folder)
            dcp.save(payload, storage_writer=writer, no_dist=True)
            return {path: s.record()[1] for path, s in streams.items()}
        dcp.save(payload, storage_writer=FileSystemWriter(folder), no_dist=True)
        if way == "plain":
            return {}
        return {os.path.join(d, f): file_checksum(os.path.join(d, f))
                for d, _, names in os.walk(folder) for f in names}

    seconds: dict[str, list[float]] = {w: [] for w in WAYS}
    size = 0
    for r in range(args.rounds + 1):  # the first round warms up, unrecorded
        for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
            with tempfile.TemporaryDirectory(prefix="rtx-checksum-") as folder:
                began = time.perf_counter()
                sums = write(way, folder)
                spent = time.perf_counter() - began
                size = _folder_bytes(folder)
                if way == "streamed":  # the streamed hashes are the files' own
                    assert all(file_checksum(p) == h for p, h in sums.items()), "hash differs"
            if r:
                seconds[way].append(spent)
        print(f"round {r}/{args.rounds}: " + ", ".join(
            f"{w} {seconds[w][-1]:.3f}s" for w in WAYS if seconds[w]), flush=True)
    median = {w: statistics.median(seconds[w]) for w in WAYS}
    rows = [{"way": w, "median s": median[w], "MB/s": size / median[w] / 1e6,
             "vs plain": median["plain"] / median[w]} for w in WAYS]
    print(f"checkpoint part of {size / 1e6:.1f} MB, {args.rounds} rounds")
    print_table(rows, ["way", "median s", "MB/s", "vs plain"])
    out = {"args": vars(args), "bytes": size, "seconds": seconds, "median_s": median,
           "ratio_to_plain": {w: median["plain"] / median[w] for w in WAYS}}
    print(f"wrote {write_json('checkpoint_checksum_cpu', out, args.json)}")


if __name__ == "__main__":
    main()
