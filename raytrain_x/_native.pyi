"""Typed stub of the native fusion core (built from native/ by CMake).

Arrays are anything that speaks DLPack or the buffer protocol (torch, numpy, TensorFlow,
cupy host arrays). Errors are ValueError with the offending tensor named; the Python layer
`raytrain_x.engine` turns them into ConfigError.
"""

from collections.abc import Sequence
from typing import Any

class FusionBuffer:
    """A persistent, 64-byte aligned buffer of one dtype, grown geometrically and reused."""

    def __init__(self, dtype: str, initial_bytes: int = 0) -> None: ...
    def reserve(self, nbytes: int) -> None:
        """Makes room for `nbytes`; growing invalidates earlier views."""
    @property
    def dtype(self) -> str: ...
    @property
    def itemsize(self) -> int: ...
    @property
    def capacity_bytes(self) -> int: ...
    @property
    def capacity_elements(self) -> int: ...
    @property
    def allocations(self) -> int:
        """How many times the buffer allocated memory (stays constant in steady state)."""
    @property
    def address(self) -> int: ...
    def view(self, count: int) -> Any:
        """A 1-D DLPack/buffer-protocol array over the first `count` elements."""

def pack(
    tensors: Sequence[Any],
    buffer: FusionBuffer | Any,
    prescale: float = 1.0,
    offset: int = 0,
    names: Sequence[str] = (),
) -> int:
    """Copies tensors back to back into `buffer` from element `offset`, multiplied by
    `prescale`; float32 tensors may go into a float16/bfloat16 buffer. Returns elements."""

def unpack(
    buffer: FusionBuffer | Any,
    tensors: Sequence[Any],
    postscale: float = 1.0,
    offset: int = 0,
    names: Sequence[str] = (),
) -> int:
    """Copies back out of `buffer` into `tensors` (casting back to float32 if needed),
    multiplied by `postscale`. Returns elements."""

def get_num_threads() -> int: ...
def set_num_threads(n: int) -> None:
    """Threads used for batches over 1 MiB; 0 restores the default (cores, at most 8)."""

class ResponseCache:
    """LRU of agreed tensor descriptions with stable slots; capacity 0 disables it."""

    def __init__(self, capacity: int) -> None: ...
    @property
    def capacity(self) -> int: ...
    @property
    def words(self) -> int:
        """Length of a bit vector in 64-bit words."""
    def __len__(self) -> int: ...
    def __contains__(self, name: str) -> bool: ...
    def put(self, name: str, dtype: str, shape: Sequence[int], op: str) -> int:
        """Stores an entry, evicting the least recently used when full; returns its slot
        (-1 when disabled)."""
    def get(self, name: str) -> dict[str, Any] | None:
        """The entry (name, dtype, shape, op, slot), marked most recently used."""
    def peek(self, name: str) -> dict[str, Any] | None:
        """The entry without touching the LRU order (ranks must keep identical orders)."""
    def slot(self, name: str) -> int: ...
    def erase(self, name: str) -> bool: ...
    def clear(self) -> None: ...
    def bits(self, names: Sequence[str]) -> list[int]:
        """One bit per slot, set for each cached name, as 64-bit words."""
    def entries_for_bits(self, bits: Sequence[int]) -> list[dict[str, Any]]:
        """Entries whose bits are set, in slot order (identical on every rank)."""
    def names_for_bits(self, bits: Sequence[int]) -> list[str]:
        """The names of `entries_for_bits(bits)`, in the same order."""
    def touch_bits(self, bits: Sequence[int]) -> None:
        """Marks the entries whose slot bit is set most recently used, in slot order."""
    def lru_order(self) -> list[str]: ...

class ShmGroup:
    """Collectives among the processes of one host through a POSIX shared-memory segment.

    Rank 0 creates the segment (`create=True`), the others open it by `name` afterwards;
    call `unlink()` once every rank has opened it. Every method below is collective over
    all `size` members and releases the GIL. A wait raises RuntimeError after `timeout_s`,
    within about 100 ms of a peer process dying, or at once after a peer's `abort()`.
    """

    def __init__(self, name: str, rank: int, size: int, slot_bytes: int, create: bool,
                 timeout_s: float) -> None: ...
    def unlink(self) -> None:
        """Removes the segment's name (mappings stay valid)."""
    def peers_visible(self) -> bool:
        """True when every member's process can be seen from here (same PID namespace)."""
    def allreduce(self, array: Any, op: str = "sum") -> None:
        """In-place allreduce of a contiguous CPU array: sum, min, max, product or band;
        every rank gets bit-identical results (slots combined in rank order)."""
    def allreduce_many(self, arrays: Sequence[Any], op: str = "sum", prescale: float = 1.0,
                       postscale: float = 1.0) -> None:
        """One allreduce over several arrays of one dtype, as if back to back, filled and
        drained in place (scaling floating arrays on the way in and out)."""
    def allgather_shards(self, array: Any) -> None:
        """Member r owns elements [n*r//size, n*(r+1)//size); afterwards all hold all."""
    def abort(self) -> None:
        """Makes every member's current and future waits fail."""
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def barriers(self) -> int:
        """Barriers this member has passed (two per chunk on the split path, else one)."""
