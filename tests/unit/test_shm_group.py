"""The native shared-memory group: arithmetic, chunking, and failing instead of hanging.

Members are threads of this process, each with its own mapping of the segment (the
barrier and the arithmetic do not care whether peers are threads or processes); one test
uses a real second process to check that a dead peer is noticed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest
import torch

from raytrain_x import _native

SLOT = 4096  # small slots, so modest tensors already span many chunks


def _name() -> str:
    return f"/rtx-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _run(size: int, fn, slot: int = SLOT, timeout_s: float = 10.0) -> list:
    """Runs fn(group, rank) on `size` threads sharing one segment; returns their results."""
    name = _name()
    groups = [_native.ShmGroup(name, 0, size, slot, True, timeout_s)]
    groups += [_native.ShmGroup(name, r, size, slot, False, timeout_s) for r in range(1, size)]
    groups[0].unlink()
    results: list = [None] * size

    def body(r: int) -> None:
        try:
            results[r] = fn(groups[r], r)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results[r] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def _inputs(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 10).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int32, torch.int64, torch.int8, torch.uint8])
@pytest.mark.parametrize("op", ["sum", "min", "max", "product"])
def test_matches_sequential_torch_arithmetic(size, dtype, op):
    n = 5000  # several chunks of SLOT bytes, and a ragged last chunk
    inputs = [_inputs(r, n, dtype) for r in range(size)]
    combine = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum,
               "product": torch.mul}[op]
    want = inputs[0].clone()
    for t in inputs[1:]:  # rank order, rounding after every step (as torch does per op)
        want = combine(want, t).to(dtype)

    def body(group, r):
        t = inputs[r].clone()
        group.allreduce(t, op)
        return t

    for got in _run(size, body):
        assert not isinstance(got, BaseException), got
        assert torch.equal(got, want)


def test_split_path_on_large_chunks_is_bit_identical_on_every_rank():
    # 3 ranks with chunks >= 256 KB: each rank sums its share, the others copy it out
    inputs = [torch.randn(300_000, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    want = inputs[0] + inputs[1] + inputs[2]

    def body(group, r):
        t = inputs[r].clone()
        group.allreduce(t)
        return t

    results = _run(3, body, slot=512 << 10)
    for got in results:
        assert torch.equal(got, want)


def test_bitwise_and_on_integers_and_numpy_arrays():
    def body(group, r):
        a = np.array([0b1111, 0b1010, -1], dtype=np.int64)
        a[0] &= ~(1 << r)
        group.allreduce(a, "band")
        return a.tolist()

    assert _run(3, body) == [[0b1000, 0b1010, -1]] * 3


def test_bad_input_is_a_clear_error():
    group = _native.ShmGroup(_name(), 0, 1, SLOT, True, 1.0)
    group.unlink()
    with pytest.raises(ValueError, match="unsupported reduce op"):
        group.allreduce(torch.ones(2), "xor")
    with pytest.raises(ValueError, match="bitwise AND needs an integer"):
        group.allreduce(torch.ones(2), "band")
    with pytest.raises(ValueError, match="contiguous CPU array"):
        group.allreduce(torch.ones(4, 4).t(), "sum")
    with pytest.raises(ValueError, match="multiple of 64"):
        _native.ShmGroup(_name(), 0, 2, 100, True, 1.0)
    with pytest.raises(RuntimeError, match="No such file"):
        _native.ShmGroup(_name(), 1, 2, SLOT, False, 1.0)


def test_missing_peer_times_out_instead_of_hanging():
    name = _name()
    group = _native.ShmGroup(name, 0, 2, SLOT, True, 0.5)
    _native.ShmGroup(name, 1, 2, SLOT, False, 0.5)  # registered, alive, never calls
    group.unlink()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out after 0.5"):
        group.allreduce(torch.ones(8))
    assert time.monotonic() - start < 3


def test_abort_releases_a_waiting_peer_at_once():
    def body(group, r):
        if r == 1:
            time.sleep(0.3)
            group.abort()
            return "aborted"
        start = time.monotonic()
        try:
            group.allreduce(torch.ones(8))
        except RuntimeError as exc:
            return (str(exc), time.monotonic() - start)
        return "no error"

    (text, waited), aborted = _run(2, body, timeout_s=30)
    assert aborted == "aborted" and "gave up" in text and waited < 2


def test_dead_peer_process_is_noticed_within_a_second():
    name = _name()
    group = _native.ShmGroup(name, 0, 2, SLOT, True, 30.0)
    code = ("import sys, time; from raytrain_x import _native; "
            f"g = _native.ShmGroup({name!r}, 1, 2, {SLOT}, False, 30.0); "
            "print('open', flush=True); time.sleep(60)")
    peer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout.readline().strip() == "open"
        group.unlink()
        threading.Timer(0.3, peer.kill).start()  # left unreaped: a zombie counts as dead
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 .* has died"):
            group.allreduce(torch.ones(8))
        assert time.monotonic() - start < 2
    finally:
        peer.kill()
        peer.wait()


@pytest.mark.parametrize("size,count", [(2, 5000), (3, 4097), (4, 3), (3, 1)])
def test_allgather_shards_gives_every_rank_every_shard(size, count):
    want = torch.arange(count, dtype=torch.float64)

    def body(group, r):
        t = torch.full((count,), -1.0, dtype=torch.float64)
        lo, hi = count * r // size, count * (r + 1) // size
        t[lo:hi] = want[lo:hi]  # this rank owns only its shard
        group.allgather_shards(t)
        return t

    for got in _run(size, body):
        assert torch.equal(got, want)


@pytest.mark.parametrize("size,share", [(2, 3000), (3, 1501), (4, 1), (1, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64])
def test_reduce_scatter_gives_each_rank_its_share_of_the_sum(size, share, dtype):
    """Shares spanning many chunks of a small slot, a ragged last chunk, one element each;
    the input is left as it was."""
    inputs = [_inputs(r, size * share, dtype) for r in range(size)]
    want = inputs[0].clone()
    for t in inputs[1:]:
        want = (want + t).to(dtype)

    def body(group, r):
        t = inputs[r].clone()
        out = torch.empty(share, dtype=dtype)
        if dtype == torch.int64:  # a read-only input (as TensorFlow's kernels hand over)
            source = t.numpy()
            source.flags.writeable = False
            out = out.numpy()
            group.reduce_scatter(source, out)
            out = torch.from_numpy(out)
        else:
            group.reduce_scatter(t, out)
        return out, torch.equal(t, inputs[r])

    for r, got in enumerate(_run(size, body)):
        assert not isinstance(got, BaseException), got
        out, untouched = got
        assert untouched
        assert torch.equal(out, want[r * share:(r + 1) * share])


def test_reduce_scatter_rejects_shares_that_do_not_fit():
    def body(group, r):
        for inp, out in ((torch.zeros(6), torch.zeros(4)), (torch.zeros(7), torch.zeros(3)),
                         (torch.zeros(6), torch.zeros(3, dtype=torch.float64))):
            with pytest.raises(ValueError, match="one share of the input"):
                group.reduce_scatter(inp, out)
        return True

    assert _run(2, body) == [True, True]


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_allreduce_many_equals_one_allreduce_of_the_concatenation(size, dtype):
    counts = [5, 0, 1, 2000, 3, 1500, 0, 700]  # spans chunks, with empty pieces
    floating = dtype.is_floating_point
    pre, post = (0.5, 0.25) if floating else (1.0, 1.0)

    def body(group, r):
        pieces = [_inputs(r * 10 + i, n, dtype) for i, n in enumerate(counts)]
        flat = torch.cat(pieces)
        if floating:
            flat = (flat * pre).to(dtype)
        group.allreduce_many(pieces, "sum", pre, post)
        group.allreduce(flat, "sum")
        if floating:
            flat = (flat * post).to(dtype)
        return torch.cat(pieces), flat

    for many, one in _run(size, body):
        assert torch.equal(many, one)


def test_allreduce_many_rejects_mixed_or_unscalable_input():
    group = _native.ShmGroup(_name(), 0, 1, SLOT, True, 1.0)
    group.unlink()
    with pytest.raises(ValueError, match="one fused batch holds one dtype"):
        group.allreduce_many([torch.ones(2), torch.ones(2, dtype=torch.float64)])
    with pytest.raises(ValueError, match="scaling needs a floating dtype"):
        group.allreduce_many([torch.ones(2, dtype=torch.int32)], "sum", 2.0)
