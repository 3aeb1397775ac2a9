"""Round trips through the native packer: every dtype, odd and empty shapes, scaling, casting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raytrain_x import ConfigError, _native
from raytrain_x.engine import FusionBuffer, FusionBufferPool, pack, unpack

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.int8,
    torch.uint8,
]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (0, 4), (2, 3, 1), (1023,), (257, 3)]


def _tensors(dtype: torch.dtype, shapes=SHAPES, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    return [torch.randint(0, 100, s, generator=gen).to(dtype) for s in shapes]


def _elements(tensors) -> int:
    return sum(t.numel() for t in tensors)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype(dtype):
    tensors = _tensors(dtype)
    n = _elements(tensors)
    buf = FusionBuffer(str(dtype).removeprefix("torch."), n * tensors[0].element_size())
    assert pack(tensors, buf) == n
    flat = torch.from_dlpack(buf.view(n))
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in tensors]))
    outs = [torch.empty_like(t) for t in tensors]
    assert unpack(buf, outs) == n
    for src, out in zip(tensors, outs):
        assert torch.equal(src, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("prescale,postscale", [(0.5, 1.0), (1.0, 0.25), (3.0, 1 / 3)])
def test_scaling_matches_torch(dtype, prescale, postscale):
    tensors = _tensors(dtype, seed=1)
    n = _elements(tensors)
    buf = FusionBuffer(str(dtype).removeprefix("torch."), n * 8)
    pack(tensors, buf, prescale=prescale)
    expected_flat = torch.cat([t.reshape(-1) for t in tensors]).mul(prescale)
    assert torch.equal(torch.from_dlpack(buf.view(n)), expected_flat)
    outs = [torch.empty_like(t) for t in tensors]
    unpack(buf, outs, postscale=postscale)
    for t, out in zip(tensors, outs):
        assert torch.equal(out, t.mul(prescale).mul(postscale))


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_cast_float32_to_half_and_back(wire):
    tensors = [t * 50 for t in _tensors(torch.float32, seed=2)]
    n = _elements(tensors)
    buf = FusionBuffer(wire, n * 2)
    pack(tensors, buf, prescale=0.5)
    wire_dtype = getattr(torch, wire)
    expected = torch.cat([t.reshape(-1) for t in tensors]).mul(0.5).to(wire_dtype)
    assert torch.equal(torch.from_dlpack(buf.view(n)), expected)
    outs = [torch.empty_like(t) for t in tensors]
    unpack(buf, outs, postscale=2.0)
    for t, out in zip(tensors, outs):
        assert torch.equal(out, t.mul(0.5).to(wire_dtype).float().mul(2.0))


def test_half_conversion_special_values():
    x = torch.tensor(
        [0.0, -0.0, 1e-8, 6e-8, 6.1e-5, 65504.0, 65520.0, 1e6, -1e6, float("inf"), float("nan")]
    )
    for wire in ("float16", "bfloat16"):
        buf = FusionBuffer(wire, 64)
        pack([x], buf)
        got = torch.from_dlpack(buf.view(x.numel()))
        want = x.to(getattr(torch, wire))
        assert torch.equal(got[:-1], want[:-1])
        assert torch.isnan(got[-1])


def test_large_batch_is_split_across_threads_and_stays_exact():
    tensors = [torch.randn(n) for n in (3_000_001, 17, 2_500_000, 1)]
    total = _elements(tensors)
    buf = FusionBuffer("float32", total * 4)
    for threads in (1, 2, 3):
        _native.set_num_threads(threads)
        try:
            pack(tensors, buf, prescale=2.0)
            outs = [torch.empty_like(t) for t in tensors]
            unpack(buf, outs, postscale=0.5)
        finally:
            _native.set_num_threads(0)
        for t, out in zip(tensors, outs):
            assert torch.equal(out, t)


def test_offset_and_numpy_and_array_buffer():
    a = np.arange(5, dtype=np.float64)
    b = np.arange(3, dtype=np.float64) + 10
    dest = np.zeros(10, dtype=np.float64)
    assert pack([a, b], dest, offset=2) == 8
    assert dest.tolist() == [0, 0, 0, 1, 2, 3, 4, 10, 11, 12]
    out = np.empty(3)
    unpack(dest, [out], offset=7)
    assert out.tolist() == [10, 11, 12]


def test_buffer_is_persistent_and_grows_geometrically():
    pool = FusionBufferPool()
    first = pool.get(torch.float32, 1000)
    for _ in range(50):
        assert pool.get(torch.float32, 1000) is first
    assert pool.allocations() == 1
    pool.get(torch.float32, 1 << 20)
    assert first.capacity_bytes >= 1 << 20
    assert first.address % 64 == 0
    assert pool.allocations() == 2
    assert pool.get(torch.float16, 10) is not first


def test_view_past_capacity_is_an_error():
    buf = FusionBuffer("float32", 64)
    with pytest.raises(ValueError, match="exceeds capacity"):
        buf.view(17)


@pytest.mark.parametrize(
    "make_args,match",
    [
        (lambda b: ([torch.randn(3, 4).t()], b), "not contiguous"),
        (lambda b: ([torch.randn(3), torch.randn(3, dtype=torch.float64)], b), "has dtype float64"),
        (lambda b: ([torch.randn(10_000)], b), "buffer too small"),
        (lambda b: ([torch.zeros(3, dtype=torch.complex64)], b), "unsupported dtype"),
        (lambda b: ([torch.ones(3, dtype=torch.int32)], b), "buffer is float32"),
        (lambda b: ([], b), "at least one tensor"),
    ],
)
def test_bad_pack_input_is_a_clear_error(make_args, match):
    buf = FusionBuffer("float32", 1024)
    with pytest.raises(ConfigError, match=match):
        pack(*make_args(buf), names=["grad.a", "grad.b"])


def test_error_names_the_tensor():
    buf = FusionBuffer("float32", 1024)
    with pytest.raises(ConfigError, match="'layer2.weight' \\(index 1\\)"):
        pack([torch.randn(2), torch.randn(4, 4).t()], buf, names=["layer1.bias", "layer2.weight"])


def test_integer_scaling_rejected():
    buf = FusionBuffer("int64", 1024)
    with pytest.raises(ConfigError, match="needs floating point"):
        pack([torch.arange(4)], buf, prescale=0.5)


def test_unpack_into_read_only_array_is_a_clear_error():
    buf = FusionBuffer("float32", 64)
    pack([torch.ones(4)], buf)
    ro = np.zeros(4, dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises(ConfigError, match="writable"):
        unpack(buf, [ro])


def test_unsupported_buffer_dtype():
    with pytest.raises(ConfigError, match="unsupported dtype 'complex64'"):
        FusionBufferPool().get("complex64", 16)


def test_a_batch_back_to_back_in_one_buffer_is_one_span_and_anything_else_is_none():
    from raytrain_x.torch.arrays import TORCH

    flat = torch.arange(12.0)
    a, b, c = flat[0:3], flat[3:9].view(2, 3), flat[9:12]
    span = TORCH.span([a, b, c])
    assert span.data_ptr() == flat.data_ptr() and span.numel() == 12
    span *= 2  # the span is the gradients' own memory: no copy
    assert torch.equal(flat, torch.arange(12.0) * 2)
    assert torch.equal(TORCH.span([b, c]), flat[3:])
    assert TORCH.span([b, a]) is None  # not in batch order: a packed batch's order differs
    assert TORCH.span([a, c]) is None  # a gap
    assert TORCH.span([torch.ones(3), torch.ones(3)]) is None  # two buffers
    assert TORCH.span([flat[0:6].view(3, 2).t(), flat[6:]]) is None  # not contiguous
    assert TORCH.span([flat[0:2], flat.to(torch.float64)[2:]]) is None


@pytest.mark.parametrize("offset", [2**64 - 1, 2**64 - 3, 11])
def test_an_offset_past_the_buffer_is_refused_without_wrapping(offset):
    """`offset + n > capacity` wrapped for offsets near 2^64: a write before the buffer
    through the public `offset=`."""
    dest = np.zeros(10, dtype=np.float64)
    guard = dest.copy()
    with pytest.raises(ValueError, match="buffer too small"):
        pack([np.ones(5)], dest, offset=offset)
    with pytest.raises(ValueError, match="buffer too small"):
        unpack(dest, [np.empty(5)], offset=offset)
    assert np.array_equal(dest, guard)


_NO_THREADS = """
import resource
import numpy as np
from raytrain_x import _native
from raytrain_x.engine import FusionBuffer, pack, unpack
rng = np.random.default_rng(0)
arrays = [rng.standard_normal(n).astype(np.float32) for n in (3_000_001, 17, 2_500_000, 1)]
buf = FusionBuffer("float32", sum(a.size for a in arrays) * 4)
outs = [np.empty_like(a) for a in arrays]
_native.set_num_threads(4)
size_kb = int(next(x for x in open("/proc/self/status") if x.startswith("VmSize")).split()[1])
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
# 2 MB of address space to spare: no thread's stack (8 MB) fits, so none can start
resource.setrlimit(resource.RLIMIT_AS, ((size_kb + 2048) * 1024, hard))
pack(arrays, buf, prescale=2.0)
unpack(buf, outs, postscale=0.5)
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
assert all(np.array_equal(o, a) for o, a in zip(outs, arrays))
print("exact")
"""


def test_a_copy_that_cannot_start_its_threads_does_it_on_one():
    """A failed thread start in `copy_segments` raised out of the copy or, with threads
    already started, called std::terminate on the whole process."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _NO_THREADS], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "exact", out.stderr[-2000:]
