"""The rendezvous store actor at scale, on a local Ray (the real actor, emulated ranks).

1. Writes under parked callers: what one write costs while P calls wait for other keys (as
   the waits of a round's members do while the round forms), with the store sized for the
   job (`control_concurrency`). Each sample is one `set` of a key nobody waits for, timed
   from the driver; the median of --writes samples per P. A write that does not come back
   within --give-up-s is reported as stuck (with Ray's default concurrency, 1,000 parked
   calls queued every later call).
2. A round forms: N emulated workers (coroutines in --hosts Ray actor processes) join at
   the real rounds actor; the driver sees them all waiting, plans and publishes the round;
   each then meets its world group at the real store actor as a gloo rank does, either
   reading every rank's address (`--way full-mesh`, gloo's full mesh in one `multi_get`)
   or its two ring neighbours' (`--way lazy`, pairs connected when first used). Reported:
   the time to join, to publish, to meet, the whole round, and store calls per worker.
3. The driver's liveness work: --driver members, each asked `heartbeat` by the real
   `WorkerPool.beat` once a second and recorded by `Heartbeats` (the straggler poll), the
   calls answered by 4 Ray actors; the driver process's CPU seconds a second, with
   `HEARTBEATS_PER_POLL` calls a poll and with a call to every member each poll.
4. The driver's watch over the training: --poll members, each with its `execute` call
   out, the real `WorkerPool.poll` in a loop as the driver runs it (a 0.1 s wait for an
   outcome each), one call returning a second, against a `ray.wait` over every member's
   call each poll (the driver's way before); the driver process's CPU seconds a second.
5. Planning a round: `plan_round` for --plan members, each on a node of its own (the
   driver's work per round), the median of 5.
6. The driver while a round waits for its workers: --forming members of the last round
   come back to the rendezvous over --forming-spread-s seconds (as after a failure); the
   real `RoundForming.step` runs after each 0.1 s `WorkerPool.poll`, with its join watch
   (`threshold`: woken once the joins its decision waits for land), against one woken at
   every join (`each-join`) and none (`none`: a look each poll). Reported: the driver's
   looks, its calls to the rounds actor, its CPU seconds, and the time from the last join
   to the round published.

Run alone: .venv/bin/python benchmarks/control_plane.py [--parked 0 1000 10000]
    [--round 64 256 1024 4096] [--way lazy full-mesh] [--forming 64 1024 4096]
Writes results/control_plane.json (--plot: the rounds' figure,
docs/images/control_plane_rounds.png).
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


_EMULATED_HOST = None


def _emulated_host_class():
    """The Ray actor class that runs one host's emulated workers (made once, after
    `ray.init`)."""
    global _EMULATED_HOST
    if _EMULATED_HOST is None:
        import ray

        @ray.remote(num_cpus=0)
        class EmulatedHost:
            """Emulated workers of one host, as coroutines. Each joins the round at the
            rounds actor, then meets its world group at the store as a gloo rank of that
            round does: `full-mesh`, its address (154 + 8N bytes) and every rank's in one
            `multi_get` (a group's full mesh, each address carrying a sequence number per
            peer); `lazy`, its address (154 bytes) and, for its first allreduce (a ring),
            its two neighbours', one `multi_get` each (`PeerStore`)."""

            async def ready(self) -> bool:
                return True

            async def run(self, rounds, store, worker_ids, way, timeout_s):
                import asyncio

                async def worker(worker_id):
                    place = await rounds.join.remote(worker_id, 0)
                    rank, size = place["rank"], place["size"]
                    prefix = f"rtx/round{place['round']}/world/0/"
                    if way == "full-mesh":
                        await store.set.remote(prefix + str(rank), b"x" * (154 + 8 * size))
                        got = await store.multi_get.remote(
                            [prefix + str(r) for r in range(size)], timeout_s)
                        assert isinstance(got, list), got
                    else:
                        await store.set.remote(prefix + str(rank), b"x" * 154)
                        for peer in sorted({(rank - 1) % size, (rank + 1) % size} - {rank}):
                            got = await store.multi_get.remote([prefix + str(peer)], timeout_s)
                            assert isinstance(got, list), got
                    return time.time()

                ends = await asyncio.gather(*(worker(w) for w in worker_ids))
                return max(ends)

        _EMULATED_HOST = EmulatedHost
    return _EMULATED_HOST


def round_cost(size: int, way: str, hosts: int, per_node: int, timeout_s: float) -> dict:
    """A round of `size` emulated workers forms: they join at the real rounds actor, the
    driver sees them all waiting, plans and publishes the round (`plan_round`), and each
    meets its world group's peers at the real store actor (`way`). Timed from the first
    join to the last worker done."""
    import ray

    from raytrain_x.comm.store_actor import StoreActor, control_concurrency
    from raytrain_x.ray.elastic.rounds import ElasticRounds, plan_round

    concurrency = control_concurrency(size)
    rounds = ElasticRounds.options(max_concurrency=concurrency).remote()
    store = StoreActor.options(max_concurrency=concurrency).remote()
    emulated = [_emulated_host_class().remote() for _ in range(hosts)]
    try:
        ray.get([h.ready.remote() for h in emulated] + [rounds.waiting.remote(),
                                                         store.num_keys.remote()])
        workers = [f"w{i}" for i in range(size)]
        began = time.time()
        done = [h.run.remote(rounds, store, workers[i::hosts], way, timeout_s)
                for i, h in enumerate(emulated)]
        while len(ray.get(rounds.waiting.remote())) < size:
            time.sleep(0.02)
        joined = time.time()
        members = {w: (f"node{i // per_node}", i) for i, w in enumerate(workers)}
        ray.get(rounds.publish.remote(plan_round(members, 1, 0)))
        published = time.time()
        ended = max(ray.get(done))
        calls = ray.get(store.calls.remote())
        return {"workers": size, "way": way, "join_s": joined - began,
                "publish_s": published - joined, "meet_s": ended - published,
                "round_s": ended - began,
                "store_calls_per_worker": sum(calls.values()) / size}
    finally:
        for actor in [rounds, store, *emulated]:
            ray.kill(actor, no_restart=True)


def _joining_host_class():
    """The Ray actor class whose coroutines join the rounds actor as a round's members do
    after a failure: each at its own time (made once, after `ray.init`)."""
    import ray

    @ray.remote(num_cpus=0)
    class JoiningHost:
        async def ready(self) -> bool:
            return True

        async def join(self, rounds, worker_ids, offsets_s):
            import asyncio

            began = time.time()

            async def worker(worker_id, offset_s):
                await asyncio.sleep(max(0.0, began + offset_s - time.time()))
                sent = time.time()
                await rounds.join.remote(worker_id, 1)
                return sent

            return max(await asyncio.gather(*(worker(w, o)
                                              for w, o in zip(worker_ids, offsets_s))))

    return JoiningHost


class _CountedRounds:
    """The driver's `RoundsClient` with its calls to the rounds actor counted; `watch`:
    `threshold`, the client's own join watch; `each-join`, one that ends at every join;
    `none`, no watch (the driver looks every 0.1 s poll)."""

    def __init__(self, client, watch: str) -> None:
        self.client, self.watch, self.calls = client, watch, 0
        self.seen = 0  # how many waited at the driver's last look

    def __getattr__(self, name):
        method = getattr(self.client, name)
        if not callable(method):
            return method

        def counted(*args, **kwargs):
            if name == "watch_joins":
                if self.watch == "none":
                    return None
                if self.watch == "each-join":
                    args = (self.seen + 1, *args[1:])
                sent = self.client._join_watch
                out = method(*args, **kwargs)
                self.calls += self.client._join_watch is not sent
                return out
            self.calls += 1
            out = method(*args, **kwargs)
            if name == "waiting":
                self.seen = len(out)
            return out

        return counted


def forming_cost(size: int, spread_s: float, hosts: int, per_node: int, watch: str) -> dict:
    """The driver's work while a round waits for its workers: `size` members of the last
    round (committed) come back to the rendezvous at even intervals over `spread_s` (as
    survivors do after a failure), joining the real rounds actor from `hosts` Ray actor
    processes; the driver runs the real `RoundForming.step` after each `WorkerPool.poll`
    (a 0.1 s wait that a join watch ends early) until the round is published. Reported:
    the driver's looks, its calls to the rounds actor, its CPU seconds, and the time from
    the last join to the round published."""
    import types

    import ray

    from raytrain_x.comm.store_actor import control_concurrency
    from raytrain_x.ray.elastic.blacklist import Blacklist
    from raytrain_x.ray.elastic.context import JobContext
    from raytrain_x.ray.elastic.events import EventLog
    from raytrain_x.ray.elastic.member_watch import MemberWatch
    from raytrain_x.ray.elastic.parts import JobParts, RoundsClient
    from raytrain_x.ray.elastic.pool import Member, WorkerPool
    from raytrain_x.ray.elastic.round_forming import RoundForming
    from raytrain_x.ray.elastic.rounds import ElasticRounds
    from raytrain_x.ray.elastic.settings import ElasticSettings

    settings = ElasticSettings(
        min_workers=1, max_workers=size, cpus_per_worker=1, gpus_per_worker=0,
        resources_per_worker={}, reset_limit=None, cooldown_range=None,
        elastic_timeout=600.0, timeout_s=600.0)
    rounds = ElasticRounds.options(max_concurrency=control_concurrency(size)).remote()
    joining = [_joining_host_class().remote() for _ in range(hosts)]
    try:
        ray.get([h.ready.remote() for h in joining] + [rounds.commit.remote(1)])
        client = _CountedRounds(RoundsClient(rounds), watch)
        pool = WorkerPool(settings, time.monotonic)
        workers = [f"w{i}" for i in range(size)]
        for i, w in enumerate(workers):
            pool.members[w] = Member(w, None, f"node{i // per_node}", i, rank=i)
        parts = JobParts(pool=pool, rounds=client, sleep=time.sleep, wall_clock=time.time,
                         close=lambda: None,
                         cluster=types.SimpleNamespace(autoscaled=False, capacity=None),
                         store=types.SimpleNamespace(forget=lambda prefix: None))
        ctx = JobContext(settings, time.monotonic, parts, EventLog(time.monotonic),
                         Blacklist(None, time.monotonic), rounds=1, needs_round=True,
                         round_members={1: set(workers)})
        forming = RoundForming(ctx, MemberWatch(ctx))
        offsets = [spread_s * i / max(1, size - 1) for i in range(size)]
        done = [h.join.remote(rounds, workers[i::hosts], offsets[i::hosts])
                for i, h in enumerate(joining)]
        looks, cpu = 0, time.process_time()
        needs_round = True
        while needs_round:
            pool.poll(timeout_s=0.1)
            looks += 1
            needs_round = forming.step(True)
        published, cpu = time.time(), time.process_time() - cpu
        last_join = max(ray.get(done))  # when the last join was sent
        return {"workers": size, "spread_s": spread_s, "watch": watch, "looks": looks,
                "rounds_calls": client.calls, "driver_cpu_s": cpu,
                "last_join_to_round_s": published - last_join}
    finally:
        for actor in [rounds, *joining]:
            ray.kill(actor, no_restart=True)


def driver_cost(members: int, seconds: float, most: int | None) -> dict:
    """The driver's CPU a second for the liveness of `members` emulated members: once a
    second (the straggler poll) it runs the heartbeat (`WorkerPool.beat`) and records it
    (`Heartbeats`), the members' calls answered by 4 Ray actors. `most`: the calls a poll
    (None: `HEARTBEATS_PER_POLL`; `members`: every member each poll)."""
    import ray

    from raytrain_x.ray.elastic import pool as pools
    from raytrain_x.ray.elastic.policies.liveness import Heartbeats

    @ray.remote(num_cpus=0)
    class Answering:
        async def heartbeat(self) -> tuple[float, int]:
            return (0.0, 1)

    answering = [Answering.options(max_concurrency=1_000).remote() for _ in range(4)]
    kept = pools.HEARTBEATS_PER_POLL
    try:
        ray.get([a.heartbeat.remote() for a in answering])
        if most is not None:
            pools.HEARTBEATS_PER_POLL = most
        pool = pools.WorkerPool(None, time.monotonic)
        for i in range(members):
            pool.members[f"w{i}"] = pools.Member(f"w{i}", answering[i % 4], f"node{i // 8}", i)
        beats = Heartbeats()
        polls, sent = 0, 0
        began, cpu = time.monotonic(), time.process_time()
        while time.monotonic() - began < seconds:
            answers, failed, out = pool.beat()
            beats.record(answers, failed, out, time.monotonic())
            beats.keep(pool.members)
            polls += 1
            sent += len(out)
            time.sleep(max(0.0, began + polls - time.monotonic()))
        wall = time.monotonic() - began
        return {"members": members, "calls_a_poll": most or pools.HEARTBEATS_PER_POLL,
                "cpu_s_per_s": (time.process_time() - cpu) / wall, "calls_per_s": sent / wall}
    finally:
        pools.HEARTBEATS_PER_POLL = kept
        for actor in answering:
            ray.kill(actor, no_restart=True)


def _wait_over_every_call(pool, timeout_s: float) -> int:
    """The baseline: the driver's poll as it was, a `ray.wait` over every member's call
    (the outcomes found)."""
    import ray

    refs = {m.ref: m for m in pool.members.values() if m.ref is not None}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    for ref in ready:
        ray.get(ref)
        refs[ref].ref = None
    return len(ready)


def poll_cost(members: int, seconds: float, way: str) -> dict:
    """The driver's CPU a second for watching `members` members train: every member's
    `execute` call out (answered by 4 Ray actors, never returning until the end) and
    running, then the driver's loop polls for outcomes (each a 0.1 s wait), one member's
    call returning each second (an outcome to find). `way`: `queued`, the real
    `WorkerPool.poll`; `wait-all`, a `ray.wait` over every member's call each poll."""
    import ray

    from raytrain_x.ray.elastic import pool as pools

    @ray.remote(num_cpus=0)
    class Training:
        def __init__(self) -> None:
            import asyncio

            self.ends: dict[int, asyncio.Event] = {}

        async def execute(self, index: int) -> int:
            import asyncio

            self.ends[index] = event = asyncio.Event()
            await event.wait()
            return index

        async def running(self) -> int:
            return len(self.ends)

        async def end(self, index: int) -> bool:
            self.ends[index].set()
            return True

    training = [Training.options(max_concurrency=members + 100).remote() for _ in range(4)]
    try:
        pool = pools.WorkerPool(None, time.monotonic)
        for i in range(members):
            member = pools.Member(f"w{i}", training[i % 4], f"node{i // 8}", i, rank=i)
            pool.run(member, training[i % 4].execute.remote(i))
            pool.members[member.worker_id] = member
        while sum(ray.get([t.running.remote() for t in training])) < members:
            time.sleep(0.1)
        polls, found, ended = 0, 0, 0
        began, cpu = time.monotonic(), time.process_time()
        while time.monotonic() - began < seconds:
            if time.monotonic() - began >= ended:
                training[ended % 4].end.remote(ended)
                ended += 1
            if way == "queued":
                found += len(pool.poll(timeout_s=0.1).finished)
            else:
                found += _wait_over_every_call(pool, 0.1)
            polls += 1
        wall = time.monotonic() - began
        return {"members": members, "way": way, "polls_per_s": polls / wall, "found": found,
                "cpu_s_per_s": (time.process_time() - cpu) / wall}
    finally:
        for actor in training:
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


def plot(formed: list[dict], path: str) -> None:
    """A round's formation time against its workers, each way, on log axes, with a line
    proportional to N through the first lazy point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for way, color in (("lazy", "tab:blue"), ("full-mesh", "tab:red")):
        points = [(r["workers"], r["round_s"]) for r in formed if r["way"] == way]
        if points:
            ax.plot(*zip(*points), "o-", color=color, label=way)
    lazy = [(r["workers"], r["round_s"]) for r in formed if r["way"] == "lazy"]
    if lazy:
        n0, t0 = lazy[0]
        ends = [n0, lazy[-1][0]]
        ax.plot(ends, [t0 * n / n0 for n in ends], ":", color="gray", label="proportional to N")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers in the round")
    ax.set_ylabel("seconds, first join to last peer met")
    ax.set_title("A round forms (one rounds actor, one store actor)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parked", type=int, nargs="*", default=[0, 1_000, 10_000])
    parser.add_argument("--writes", type=int, default=200)
    parser.add_argument("--give-up-s", type=float, default=15.0)
    parser.add_argument("--round", type=int, nargs="*", default=[64, 256, 1024, 4096])
    parser.add_argument("--way", nargs="+", default=["lazy", "full-mesh"],
                        choices=["lazy", "full-mesh"])
    parser.add_argument("--full-mesh-up-to", type=int, default=1024,
                        help="the largest N run the full-mesh way (N(154 + 8N) bytes a rank)")
    parser.add_argument("--hosts", type=int, default=4,
                        help="Ray actor processes the emulated workers run in")
    parser.add_argument("--per-node", type=int, default=8, help="workers per emulated node")
    parser.add_argument("--plan", type=int, nargs="*", default=[1_000, 10_000])
    parser.add_argument("--driver", type=int, nargs="*", default=[4_096],
                        help="members the driver's heartbeat runs for")
    parser.add_argument("--driver-s", type=float, default=10.0)
    parser.add_argument("--poll", type=int, nargs="*", default=[4_096],
                        help="members whose outcomes the driver's loop watches")
    parser.add_argument("--forming", type=int, nargs="*", default=[64, 1_024, 4_096],
                        help="members that come back to a round the driver waits for")
    parser.add_argument("--forming-spread-s", type=float, default=10.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="write the rounds' figure here (png)")
    args = parser.parse_args()
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rows = []
        for parked in args.parked:
            rows.append(write_cost(parked, args.writes, args.give_up_s))
            print(f"{parked} parked: {rows[-1]}", flush=True)
        formed = []
        for size in args.round:
            for way in args.way:
                if way == "full-mesh" and size > args.full_mesh_up_to:
                    continue
                formed.append(round_cost(size, way, args.hosts, args.per_node, 600.0))
                print(f"round of {size}: {formed[-1]}", flush=True)
        drivers = []
        for members in args.driver:
            for most in (None, members):
                drivers.append(driver_cost(members, args.driver_s, most))
                print(f"driver with {members}: {drivers[-1]}", flush=True)
        polls = []
        for members in args.poll:
            for way in ("queued", "wait-all"):
                polls.append(poll_cost(members, args.driver_s, way))
                print(f"outcomes of {members}: {polls[-1]}", flush=True)
        forming = []
        for members in args.forming:
            for watch in ("threshold", "each-join", "none"):
                forming.append(forming_cost(members, args.forming_spread_s, args.hosts,
                                            args.per_node, watch))
                print(f"forming with {members}: {forming[-1]}", flush=True)
    finally:
        ray.shutdown()
    plans = [plan_cost(n) for n in args.plan]
    print_table(drivers, ["members", "calls_a_poll", "cpu_s_per_s", "calls_per_s"])
    print_table(polls, ["members", "way", "polls_per_s", "found", "cpu_s_per_s"])
    print_table(rows, ["parked", "write_ms", "stuck"])
    print_table(formed, ["workers", "way", "join_s", "publish_s", "meet_s", "round_s",
                         "store_calls_per_worker"])
    print_table(plans, ["members", "plan_ms", "place_bytes"])
    print_table(forming, ["workers", "spread_s", "watch", "looks", "rounds_calls",
                          "driver_cpu_s", "last_join_to_round_s"])
    path = write_json("control_plane", {"args": vars(args), "writes": rows, "rounds": formed,
                                        "driver": drivers, "polls": polls, "plans": plans,
                                        "forming": forming},
                      args.json)
    print(f"wrote {path}")
    if args.plot and formed:
        plot(formed, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
