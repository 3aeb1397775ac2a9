"""What a restore reads from an object store, per rank: a ZeRO-1 checkpoint of the GPT
workload written by --writers ranks to moto's S3 server on loopback, then restored by
--readers ranks (a new job of another size). Bytes are counted through raytrain-x's
storage layer on each rank, from the restore's start to its end.

Reported per reading rank: bytes read, the reads it made (requests to the store), and its
share: the stored bytes of the optimizer shards it owns in the new layout, the part every
reader of a shard part reads (each part's `.metadata` and skeleton), and on rank 0 the
common part (models, attributes), which it loads; the target is read / share <= 1.1.
Writes results/restore_bytes_cpu.json.

Run: .venv/bin/python benchmarks/restore_bytes.py [--layers 4 --width 256]
"""

from __future__ import annotations

import argparse
import os

import torch

from common import join_world, lm_step, print_table, run_ranks, write_json


def _job(rank: int, size: int, port: int, uri: str, restore: bool, args, queue) -> None:
    import raytrain_x.torch as rx
    from raytrain_x.common.checkpoint_config import CheckpointConfig
    from raytrain_x.elastic.storage import bytes_read, reads_made
    from raytrain_x.torch.workloads import GPTDecoder, synthetic_tokens

    join_world(rank, size, port)
    rx.init()
    torch.manual_seed(0)
    model = GPTDecoder(layers=args.layers, width=args.width)
    opt = rx.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4),
                                  named_parameters=model.named_parameters(), zero_stage=1)
    state = rx.elastic.TorchState(model, opt, checkpoint=CheckpointConfig(uri, name="bench"),
                                  step=0)
    before, requests = bytes_read(), reads_made()
    state.sync()  # a fixed world's start: the latest checkpoint, where there is one
    read, requests = bytes_read() - before, reads_made() - requests
    if not restore:
        ids, targets = synthetic_tokens(4, seed=rank)
        lm_step(model, opt, ids, targets)
        state.step += 1
        state.commit()
        state.checkpoint()
    every = rx.allgather_object((read, requests))
    if rank == 0:
        queue.put({"read": [r for r, _ in every], "requests": [n for _, n in every],
                   "owners": opt.owners_by_index(),
                   "restored": getattr(state, "restored_from", None) is not None})
    rx.shutdown()


def main() -> None:
    from moto.server import ThreadedMotoServer

    from raytrain_x.common.checkpoint_config import CheckpointConfig
    from raytrain_x.elastic.checkpoints import CheckpointStore
    from raytrain_x.elastic.durable import part_kind
    from raytrain_x.testing.waiting import free_port
    from raytrain_x.torch.durable import shard_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--readers", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        uri = (f"s3://bench/runs?endpoint_override=127.0.0.1:{port}&scheme=http"
               "&allow_bucket_creation=true")
        run_ranks(_job, args.writers, uri, False, args)
        store = CheckpointStore(CheckpointConfig(uri, name="bench"))
        [written] = store.checkpoints()
        sizes = {part: sum(entry[0] for entry in files.values())
                 for part, files in written.parts.items()}
        common = sum(v for p, v in sizes.items() if part_kind(p) == "common")
        shard_parts = [p for p in sizes if part_kind(p) != "common"]
        by_index: dict[int, int] = {}  # each parameter's optimizer state, stored bytes
        for part in shard_parts:
            [states] = shard_bytes(store.part(written, part)).values()
            for index, size in states.items():
                by_index[index] = by_index.get(index, 0) + size
        shards = sum(sizes[p] for p in shard_parts)
        every_reader = shards - sum(by_index.values())  # metadata, skeletons
        out = run_ranks(_job, args.readers, uri, True, args)
    finally:
        server.stop()
    assert out["restored"], "the new job did not restore the checkpoint"
    rows = []
    for rank, read in enumerate(out["read"]):
        own = sum(size for i, size in by_index.items() if out["owners"].get(i) == rank)
        share = own + every_reader + (common if rank == 0 else 0)
        rows.append({"rank": rank, "read MB": read / 1e6, "own shards MB": own / 1e6,
                     "share MB": share / 1e6, "read / share": read / share,
                     "reads": out["requests"][rank]})
    print(f"checkpoint of {args.writers} ranks: common {common / 1e6:.2f} MB, shards "
          f"{shards / 1e6:.2f} MB (of which {every_reader / 1e6:.3f} MB every reader "
          f"reads); restored by {args.readers} ranks from S3 (moto)")
    print_table(rows, ["rank", "read MB", "own shards MB", "share MB", "read / share",
                       "reads"])
    payload = {"args": vars(args), "common_bytes": common, "shard_bytes": shards,
               "every_reader_bytes": every_reader, "read": out["read"],
               "requests": out["requests"],
               "ratio": [r["read / share"] for r in rows]}
    print(f"wrote {write_json('restore_bytes_cpu', payload, args.json)}")


if __name__ == "__main__":
    main()
