"""Commits off the device: a state's tensors copied into reused host memory.

A commit used to deep-copy `state_dict()` on the tensors' own device: on a GPU that doubles
the model's and optimizer's memory there, and the step waited for fresh allocations. A
`Snapshot` copies every tensor of a nested structure (dicts, lists, tuples; other leaves are
deep-copied) into host buffers kept from an earlier snapshot of the same structure, so a
commit allocates nothing once warm and takes no device memory:

- CPU tensors are copied into their buffers at once (no allocation, no page faults);
- CUDA tensors are copied into pinned buffers on a side stream, after the work already
  queued on the current stream, and the call returns without waiting. The copy must end
  before anything modifies those tensors again: `Snapshots.take(..., order=)` makes the
  current stream wait for it right away (the host still does not wait), or, where the
  caller can name the one place the next modification starts (an optimizer's step: see
  `TorchState`), leaves that wait to `Snapshot.order_before_modification` there, so the
  next forward and backward run beside the copy.

A snapshot's buffers go back to its `Snapshots` pool once nothing refers to it (the
in-memory commit, a background checkpoint write), so a commit never overwrites a snapshot
someone still reads.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

Path = tuple[Any, ...]
Buffers = dict[Path, torch.Tensor]

_KEEP_FREE = 2  # buffer sets kept for reuse: the commit being taken and the one before


def _plain(value: Any) -> bool:
    """A dense tensor whose copy is a buffer of the same shape (not a subclass: DTensor,
    parameters' subclasses keep their deep copy)."""
    return (isinstance(value, torch.Tensor) and type(value) in (torch.Tensor, torch.nn.Parameter)
            and value.layout == torch.strided and not value.is_meta)


class Snapshot:
    """A host copy of a nested structure, possibly still being copied (CUDA)."""

    def __init__(self, tree: Any, event: Any, nbytes: int) -> None:
        self._tree = tree
        self._event = event  # a CUDA event recorded after the copies, or None
        self.nbytes = nbytes  # tensor bytes copied

    def wait(self) -> None:
        """Blocks until every copy has landed in host memory."""
        if self._event is not None:
            self._event.synchronize()

    def order_before_modification(self) -> None:
        """Makes the current CUDA stream wait for the copies (the host does not wait): call
        it where the snapshotted tensors are next modified, before that work is queued."""
        if self._event is not None:
            torch.cuda.current_stream(self._event.device).wait_event(self._event)

    def tree(self) -> Any:
        """The host structure, after the copies have landed. Read it, do not modify it: its
        tensors are the pool's buffers."""
        self.wait()
        return self._tree

    def copy(self) -> Any:
        """A fresh copy of the structure (host tensors of their own): what a restore loads,
        since `load_state_dict` may keep the tensors it is given."""
        return _map(self.tree(), lambda t: t.clone(), copy.deepcopy)


class Snapshots:
    """A pool of host buffers that successive snapshots of one structure reuse."""

    def __init__(self) -> None:
        self._free: list[Buffers] = []
        self._lock = threading.Lock()  # a snapshot may be dropped on a writer's thread
        self._stream: Any = None

    def take(self, tree: Any, order: bool = True) -> Snapshot:
        """Copies `tree`'s tensors into host buffers.

        Args:
            tree: dicts, lists and tuples of tensors and other values (a `state_dict()`).
            order: for CUDA tensors, make the current stream wait for the copies now, so
                that any later work on it sees them done; with False the caller orders the
                next modification itself (`Snapshot.order_before_modification`).
        """
        with self._lock:
            buffers = self._free.pop() if self._free else {}
        used: Buffers = {}
        cuda: list[tuple[torch.Tensor, torch.Tensor]] = []

        def host_copy(path: Path, t: torch.Tensor) -> torch.Tensor:
            src = t.detach()
            buf = buffers.get(path)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(src.shape, dtype=src.dtype,
                                  pin_memory=src.is_cuda and torch.cuda.is_available())
            used[path] = buf
            if src.is_cuda:
                cuda.append((buf, src))
            else:
                buf.copy_(src)
            return buf

        out = map_paths(tree, (), host_copy)
        event = self._copy_from_devices(cuda, order) if cuda else None
        nbytes = sum(b.numel() * b.element_size() for b in used.values())
        snap = Snapshot(out, event, nbytes)
        weakref.finalize(snap, self._give_back, used)
        return snap

    def _copy_from_devices(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                           order: bool) -> Any:
        device = pairs[0][1].device
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        self._stream.wait_stream(current)  # after the work that produced the values
        with torch.cuda.stream(self._stream):
            for buf, src in pairs:
                buf.copy_(src, non_blocking=True)
                # the source's memory is not reused while the side stream reads it
                src.record_stream(self._stream)
        event = torch.cuda.Event()
        event.record(self._stream)
        if order:
            current.wait_event(event)
        return event

    def _give_back(self, buffers: Buffers) -> None:
        with self._lock:
            if len(self._free) < _KEEP_FREE:
                self._free.append(buffers)


def _container(tree: Any, items: Any) -> Any:
    """A dict of `items` of `tree`'s own kind, keeping a `state_dict`'s `_metadata`."""
    out = type(tree)(items) if type(tree) in (dict, OrderedDict) else dict(items)
    if hasattr(tree, "_metadata"):
        out._metadata = copy.deepcopy(tree._metadata)
    return out


def map_paths(tree: Any, path: Path, fn: Callable[[Path, torch.Tensor], Any]) -> Any:
    """`tree` with each dense tensor replaced by `fn(its path, it)` (other leaves
    deep-copied; dicts keep their kind and a `state_dict`'s `_metadata`)."""
    if _plain(tree):
        return fn(path, tree)
    if isinstance(tree, dict):
        return _container(tree, ((k, map_paths(v, (*path, k), fn)) for k, v in tree.items()))
    if type(tree) in (list, tuple):
        return type(tree)(map_paths(v, (*path, i), fn) for i, v in enumerate(tree))
    return copy.deepcopy(tree)


def _map(tree: Any, tensor: Callable[[torch.Tensor], Any], other: Callable[[Any], Any]) -> Any:
    if _plain(tree):
        return tensor(tree)
    if isinstance(tree, dict):
        return _container(tree, ((k, _map(v, tensor, other)) for k, v in tree.items()))
    if type(tree) in (list, tuple):
        return type(tree)(_map(v, tensor, other) for v in tree)
    return other(tree)
