"""Durable checkpoints of a `TorchState`: its committed host snapshot written to storage by
a background thread, in `torch.distributed.checkpoint` (DCP) format, and read back.

Each part of a checkpoint (`raytrain_x.elastic.checkpoints`) is a DCP checkpoint written by
one rank: `common` (models, unsharded optimizers, samplers, plain attributes; rank 0) and,
with a sharded optimizer, `shard_<rank>` (that rank's optimizer shard, by parameter index).
Plain torch reads a part with `torch.distributed.checkpoint.format_utils.dcp_to_torch_save`:
its tensors under `state`, nested as in `state_dict()`s (lists as dicts by index), and under
`skeleton` the tree's exact shape and its other values as tagged JSON.

Restoring loads tensors with `torch.load(weights_only=True)` and values from JSON; only a
value JSON cannot hold (an object of the user's own class among the attributes) is pickled,
and only a checkpoint that holds one is unpickled (docs/security.md: whoever can write the
storage path can run code in the job, through DCP's own metadata too).
The commit manager (`raytrain_x.elastic.commits`) writes and reads the parts through
`raytrain_x.torch.state_format.TorchFormat`.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from raytrain_x.torch.snapshot import map_paths

# DCP warns on every save and load outside a torch.distributed world: each part is written
# by one process on purpose
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)


_AT = "__raytrain_x_tensor_at__"  # a skeleton's placeholder: where the tensor sits
SKELETON_FORMAT = "json-skeleton"  # the manifest's `info["skeleton"]` for parts written this way


def _skeleton(tree: Any) -> Any:
    """The tree with each tensor replaced by its path: the tree's exact shape, which DCP
    does not keep (it drops empty containers and turns keys into strings)."""
    return map_paths(tree, (), lambda path, _: {_AT: list(path)})


def _tensors(tree: Any) -> Any:
    """Only the tree's tensors, nested as in the tree (lists as dicts by index); None
    where a branch holds none (DCP drops empty containers anyway)."""
    if isinstance(tree, torch.Tensor):
        return tree if tree.layout == torch.strided else None
    items = tree.items() if isinstance(tree, dict) else \
        enumerate(tree) if type(tree) in (list, tuple) else ()
    out = {k: sub for k, sub in ((k, _tensors(v)) for k, v in items) if sub is not None}
    return out or None


class _Pickled(Exception):
    """A value the skeleton's JSON cannot hold."""


def encode(value: Any, pickled: list[bool]) -> Any:
    """A skeleton as tagged JSON: lists, tuples, sets, dicts (any keys, a `state_dict`'s
    `_metadata`), bytes and plain values; anything else pickled (`pickled[0]` set)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        if set(value) == {_AT}:
            return {"@": [encode(k, pickled) for k in value[_AT]]}
        out: dict[str, Any] = {"d": [[encode(k, pickled), encode(v, pickled)]
                                     for k, v in value.items()]}
        if type(value) is OrderedDict:
            out["o"] = 1
        if hasattr(value, "_metadata"):
            out["m"] = encode(value._metadata, pickled)
        return out
    if type(value) in (list, tuple, set, frozenset):
        tag = {list: "l", tuple: "t", set: "s", frozenset: "f"}[type(value)]
        items = sorted(value, key=repr) if tag in "sf" else value
        return {tag: [encode(v, pickled) for v in items]}
    if isinstance(value, bytes):
        return {"b": base64.b64encode(value).decode()}
    pickled[0] = True
    return {"p": base64.b64encode(pickle.dumps(value)).decode()}


def decode(value: Any, allow_pickle: bool) -> Any:
    """What `encode` wrote."""
    if not isinstance(value, dict):
        return value
    ((tag, body),) = ((k, v) for k, v in value.items() if k not in ("o", "m"))
    if tag == "@":
        return {_AT: [decode(k, allow_pickle) for k in body]}
    if tag == "d":
        out = (OrderedDict if value.get("o") else dict)(
            (decode(k, allow_pickle), decode(v, allow_pickle)) for k, v in body)
        if "m" in value:
            out._metadata = decode(value["m"], allow_pickle)
        return out
    if tag in ("l", "t", "s", "f"):
        kind = {"l": list, "t": tuple, "s": set, "f": frozenset}[tag]
        return kind(decode(v, allow_pickle) for v in body)
    if tag == "b":
        return base64.b64decode(body)
    if not allow_pickle:
        raise _Pickled
    return pickle.loads(base64.b64decode(body))


def _filled(skeleton: Any, saved: Any) -> Any:
    if isinstance(skeleton, dict) and set(skeleton) == {_AT}:
        value = saved
        for key in skeleton[_AT]:
            value = value[str(key)] if isinstance(value, dict) and key not in value \
                else value[key]
        return value
    if isinstance(skeleton, dict):
        out = type(skeleton)((k, _filled(v, saved)) for k, v in skeleton.items())
        if hasattr(skeleton, "_metadata"):
            out._metadata = skeleton._metadata
        return out
    if type(skeleton) in (list, tuple):
        return type(skeleton)(_filled(v, saved) for v in skeleton)
    return skeleton


def dcp_payload(tree: Any) -> dict[str, Any]:
    """What `save` hands torch DCP for `tree`: its tensors under `state` (as the tree nests
    them), and the tree's exact shape and values under `skeleton`."""
    pickled = [False]
    skeleton = json.dumps({"format": SKELETON_FORMAT, "tree": encode(_skeleton(tree), pickled),
                           "pickled": pickled[0]})
    return {"state": _tensors(tree) or {}, "skeleton": skeleton}


def save(tree: Any, folder: str) -> dict[str, list[Any]]:
    """Writes `tree` (nested dicts of tensors and values) as a DCP checkpoint
    (`dcp_payload`); returns each file's [bytes, xxh3-128 checksum], hashed as it was
    written (a file whose hash could not be taken so is left out: it is hashed after)."""
    import torch.distributed.checkpoint as dcp

    writer, streams = hashing_writer(folder)
    dcp.save(dcp_payload(tree), storage_writer=writer, no_dist=True)
    files = {}
    for path, stream in streams.items():
        if stream.usable and os.path.exists(path) and os.path.getsize(path) == stream.size:
            files[os.path.relpath(path, folder)] = [stream.size, stream.hexdigest()]
    return files


_OVERLAP_BYTES = 1 << 20  # a write this large is hashed while it is written
_HASHER: list[Any] = []
os.register_at_fork(after_in_child=_HASHER.clear)  # a forked child has not its thread


def _hash_thread() -> Any:
    """The one thread that hashes a large write while the writer's thread writes it."""
    if not _HASHER:
        from concurrent.futures import ThreadPoolExecutor

        _HASHER.append(ThreadPoolExecutor(1, thread_name_prefix="raytrain-x-hash"))
    return _HASHER[0]


class _Hashing:
    """A file being written, hashed (xxh3-128, as manifests record) as its bytes go by:
    no second read. A seek or truncate while writing marks the hash unusable (the file
    is then hashed whole, after)."""

    def __init__(self, raw: Any, digest: Any) -> None:
        self._raw, self._digest = raw, digest
        self.size, self.usable = 0, True

    def write(self, data: Any) -> int:
        try:
            view = memoryview(data).cast("B")
        except (TypeError, ValueError):
            self.usable = False
            return self._raw.write(data)
        if not self.usable:
            return self._raw.write(data)
        if view.nbytes < _OVERLAP_BYTES:
            written = self._raw.write(data)
            self._digest.update(view)
        else:  # hashed on a helper thread while this one writes (both drop the GIL)
            hashing = _hash_thread().submit(self._digest.update, view)
            try:
                written = self._raw.write(data)
            finally:
                hashing.result()
        if written is None or written != view.nbytes:
            self.usable = False
        self.size += written or 0
        return written

    def seek(self, *args: Any) -> int:
        self.usable = False
        return self._raw.seek(*args)

    def truncate(self, *args: Any) -> int:
        self.usable = False
        return self._raw.truncate(*args)

    def hexdigest(self) -> str:
        return self._digest.hexdigest()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def hashing_writer(folder: str) -> tuple[Any, dict[str, _Hashing]]:
    """torch DCP's file system writer for `folder` whose files are hashed as they are
    written; and the files' hashes by path (a renamed file under its final name)."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    from raytrain_x.elastic.checkpoints import new_hasher

    streams: dict[str, _Hashing] = {}

    class HashingFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            with super().create_stream(path, mode) as raw:
                if "w" not in mode:
                    yield raw
                    return
                stream = _Hashing(raw, new_hasher())
                yield stream
            streams[str(path)] = stream

        def rename(self, path: Any, new_path: Any) -> None:
            super().rename(path, new_path)
            if str(path) in streams:
                streams[str(new_path)] = streams.pop(str(path))

    writer = FileSystemWriter(folder)
    writer.fs = HashingFileSystem()
    return writer, streams


def load(folder: str) -> Any:
    """Reads a DCP checkpoint `save` wrote back into the tree that was saved: tensors with
    `weights_only=True`, values from JSON (unpickled only where `save` had to pickle)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = os.path.join(folder, "..", os.path.basename(folder) + ".pt")
    dcp_to_torch_save(folder, path)
    try:
        saved = torch.load(path, weights_only=True)
    finally:
        os.remove(path)
    raw = json.loads(saved["skeleton"])
    skeleton = decode(raw["tree"], allow_pickle=bool(raw["pickled"]))
    return _filled(skeleton, saved.get("state", {}))


def _skeleton_of(folder: str) -> Any:
    """The skeleton of a part `save` wrote, without its tensors."""
    import torch.distributed.checkpoint as dcp

    head = {"skeleton": ""}
    dcp.load(head, checkpoint_id=folder, no_dist=True)
    raw = json.loads(head["skeleton"])
    return decode(raw["tree"], allow_pickle=bool(raw["pickled"]))


def load_shards(folder: str, wanted: Callable[[str, int], bool]) -> dict[str, dict[int, Any]]:
    """The optimizer shards of a `shard_<rank>` part that `wanted(optimizer, index)` picks,
    read alone: DCP reads only their tensors' bytes, so a rank never holds the others'."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(folder).read_metadata().state_dict_metadata
    skeleton = _skeleton_of(folder)
    chosen = {name: {i: sub for i, sub in states.items() if wanted(name, i)}
              for name, states in skeleton["shards"].items()}
    template: dict[str, Any] = {}

    def allocate(path: tuple, _: Any) -> None:
        entry = metadata[".".join(["state", *map(str, path)])]
        node = template
        for key in path[:-1]:
            node = node.setdefault(str(key), {})
        node[str(path[-1])] = torch.empty(entry.size, dtype=entry.properties.dtype)

    for states in chosen.values():
        for sub in states.values():
            _walk_placeholders(sub, allocate)
    if template:
        dcp.load({"state": template}, checkpoint_id=folder, no_dist=True)
    return {name: {i: _filled(sub, template) for i, sub in states.items()}
            for name, states in chosen.items()}


def _walk_placeholders(skeleton: Any, fn: Callable[[tuple, Any], None]) -> None:
    if isinstance(skeleton, dict) and set(skeleton) == {_AT}:
        fn(tuple(skeleton[_AT]), skeleton)
    elif isinstance(skeleton, dict):
        for value in skeleton.values():
            _walk_placeholders(value, fn)
    elif type(skeleton) in (list, tuple, set, frozenset):
        for value in skeleton:
            _walk_placeholders(value, fn)
