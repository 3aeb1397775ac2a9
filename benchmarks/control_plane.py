"""The rendezvous store actor at scale, on a local Ray (the real actor, emulated ranks).

1. Writes under parked callers: what one write costs while P calls wait for other keys (as
   the waits of a round's members do while the round forms), with the store sized for the
   job (`control_concurrency`). Each sample is one `set` of a key nobody waits for, timed
   from the driver; the median of --writes samples per P. A write that does not come back
   within --give-up-s is reported as stuck (with Ray's default concurrency, 1,000 parked
   calls queued every later call).
2. A group's full mesh: N emulated ranks (threads) make the store calls gloo's connect
   makes, with values of gloo's size for N (154 + 8N bytes): each rank sets its address
   and reads every rank's, either one wait and one get per key (`--mesh-way per-key`, what
   torch's gloo does through a plain store) or in one `multi_get` (`MeshStore`'s way).
   Reported: wall time until every rank has every address, and the actor's calls per rank.
3. Planning a round: `plan_round` for --plan members, each on a node of its own (the
   driver's work per round), the median of 5.

Run alone: .venv/bin/python benchmarks/control_plane.py [--parked 0 1000 10000]
    [--mesh 16 64 256] [--mesh-way per-key multi-get]
Writes results/control_plane.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import print_table, write_json


def write_cost(parked: int, writes: int, give_up_s: float) -> dict:
    import ray
    from ray.exceptions import GetTimeoutError

    from raytrain_x.comm import store_actor

    sizing = getattr(store_actor, "control_concurrency", None)
    options = {"max_concurrency": sizing(parked)} if sizing else {}
    store = store_actor.StoreActor.options(**options).remote()
    try:
        waits = [store.wait.remote([f"round1/rank{i}"], 600.0) for i in range(parked)]
        try:
            ray.get(store.num_keys.remote(), timeout=give_up_s)  # started after every wait
        except GetTimeoutError:
            return {"parked": parked, "write_ms": None, "stuck": True}
        seconds = []
        for i in range(writes):
            began = time.perf_counter()
            try:
                ray.get(store.set.remote(f"other/{i}", b"x" * 160), timeout=give_up_s)
            except GetTimeoutError:
                return {"parked": parked, "write_ms": None, "stuck": True}
            seconds.append(time.perf_counter() - began)
        del waits
        return {"parked": parked, "write_ms": 1e3 * statistics.median(seconds),
                "stuck": False}
    finally:
        ray.kill(store, no_restart=True)


def mesh_cost(size: int, way: str, give_up_s: float) -> dict:
    import threading

    import ray

    from raytrain_x.comm.store import ActorStore
    from raytrain_x.comm.store_actor import StoreActor, control_concurrency

    actor = StoreActor.options(max_concurrency=control_concurrency(size)).remote()
    store = ActorStore(actor, give_up_s)
    value = b"x" * (154 + 8 * size)
    keys = [f"round1/world/0/{r}" for r in range(size)]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            store.set(keys[r], value)
            if way == "multi-get":
                store.multi_get(keys)
                return
            for key in keys:
                store.wait([key])
                store.get(key)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(size)]
        began = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - began
        calls = ray.get(actor.calls.remote())
        return {"ranks": size, "way": way, "wall_s": wall, "failed": len(errors),
                "calls_per_rank": sum(calls.values()) / size}
    finally:
        ray.kill(actor, no_restart=True)


def plan_cost(members: int) -> dict:
    import pickle

    from raytrain_x.ray.elastic.rounds import plan_round

    nodes = {f"w{i}": (f"node{i}", i) for i in range(members)}
    seconds = []
    for _ in range(5):
        began = time.perf_counter()
        places = plan_round(nodes, 3, 1, holders=list(nodes)[:5])
        seconds.append(time.perf_counter() - began)
    return {"members": members, "plan_ms": 1e3 * statistics.median(seconds),
            "place_bytes": len(pickle.dumps(places["w0"]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parked", type=int, nargs="+", default=[0, 1_000, 10_000])
    parser.add_argument("--writes", type=int, default=200)
    parser.add_argument("--give-up-s", type=float, default=15.0)
    parser.add_argument("--mesh", type=int, nargs="*", default=[16, 64, 256])
    parser.add_argument("--mesh-way", nargs="+", default=["per-key", "multi-get"],
                        choices=["per-key", "multi-get"])
    parser.add_argument("--per-key-up-to", type=int, default=64,
                        help="the largest N run the per-key way (2N^2 calls)")
    parser.add_argument("--plan", type=int, nargs="*", default=[1_000, 10_000])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rows = []
        for parked in args.parked:
            rows.append(write_cost(parked, args.writes, args.give_up_s))
            print(f"{parked} parked: {rows[-1]}", flush=True)
        meshes = []
        for size in args.mesh:
            for way in args.mesh_way:
                if way == "per-key" and size > args.per_key_up_to:
                    continue
                meshes.append(mesh_cost(size, way, 600.0))
                print(f"mesh of {size}: {meshes[-1]}", flush=True)
    finally:
        ray.shutdown()
    plans = [plan_cost(n) for n in args.plan]
    print_table(rows, ["parked", "write_ms", "stuck"])
    print_table(meshes, ["ranks", "way", "wall_s", "calls_per_rank", "failed"])
    print_table(plans, ["members", "plan_ms", "place_bytes"])
    path = write_json("control_plane", {"args": vars(args), "writes": rows, "meshes": meshes,
                                        "plans": plans}, args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
