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
import io
import json
import os
import pickle
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from raytrain_x.common.errors import RaytrainXError
from raytrain_x.common.process import PROCESS
from raytrain_x.elastic.checksums import PartFiles, new_hasher
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
    (`dcp_payload`); returns each file's [bytes, xxh3-128 checksum, pieces], hashed as it
    was written (a file whose hash could not be taken so is left out: it is hashed after).
    The pieces, [[bytes, checksum], ...] in file order, are DCP's items: a reader of one
    item checks its bytes alone (`raytrain_x.elastic.checkpoints.PartFiles`)."""
    import torch.distributed.checkpoint as dcp

    writer, streams = hashing_writer(folder)
    dcp.save(dcp_payload(tree), storage_writer=writer, no_dist=True)
    files = {}
    for path, stream in streams.items():
        if stream.usable and os.path.exists(path) and os.path.getsize(path) == stream.size:
            files[os.path.relpath(path, folder)] = stream.record()
    return files


_OVERLAP_BYTES = 1 << 20  # a write this large is hashed while it is written


def _no_hash_thread() -> None:
    PROCESS.hash_thread = None  # a forked child has not its parent's thread


os.register_at_fork(after_in_child=_no_hash_thread)


def _hash_thread() -> Any:
    """The one thread that hashes a large write while the writer's thread writes it."""
    if PROCESS.hash_thread is None:
        from concurrent.futures import ThreadPoolExecutor

        PROCESS.hash_thread = ThreadPoolExecutor(1, thread_name_prefix="raytrain-x-hash")
    return PROCESS.hash_thread


class _Hashing:
    """A file being written, hashed (xxh3-128, as manifests record) as its bytes go by:
    no second read. Each stretch between two `tell()`s (DCP asks where it is before and
    after each item it writes) is hashed on its own too: the file's pieces, each of which
    a reader can check alone. A seek or truncate while writing marks the hash unusable
    (the file is then hashed whole, after)."""

    def __init__(self, raw: Any, digest: Any, new_digest: Callable[[], Any]) -> None:
        self._raw, self._digest, self._new = raw, digest, new_digest
        self.size, self.usable = 0, True
        self._piece, self._piece_at = new_digest(), 0
        self.pieces: list[list[Any]] = []  # [[bytes, checksum], ...] from the file's start

    def _update(self, view: memoryview) -> None:
        self._digest.update(view)
        self._piece.update(view)

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
            self._update(view)
        else:  # hashed on a helper thread while this one writes (both drop the GIL)
            hashing = _hash_thread().submit(self._update, view)
            try:
                written = self._raw.write(data)
            finally:
                hashing.result()
        if written is None or written != view.nbytes:
            self.usable = False
        self.size += written or 0
        return written

    def tell(self) -> int:
        at = self._raw.tell()
        if self.usable and at != self.size:
            self.usable = False
        elif self.usable:
            self._cut()
        return at

    def _cut(self) -> None:
        """Ends the piece under way where the file has got to (where it is not empty)."""
        if self.size > self._piece_at:
            self.pieces.append([self.size - self._piece_at, self._piece.hexdigest()])
            self._piece, self._piece_at = self._new(), self.size

    def seek(self, *args: Any) -> int:
        self.usable = False
        return self._raw.seek(*args)

    def truncate(self, *args: Any) -> int:
        self.usable = False
        return self._raw.truncate(*args)

    def record(self) -> list[Any]:
        """The file's [bytes, checksum], and its pieces where it has more than one."""
        self._cut()
        return [self.size, self._digest.hexdigest()] + \
            ([self.pieces] if len(self.pieces) > 1 else [])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def hashing_writer(folder: str) -> tuple[Any, dict[str, _Hashing]]:
    """torch DCP's file system writer for `folder` whose files are hashed as they are
    written; and the files' hashes by path (a renamed file under its final name)."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    streams: dict[str, _Hashing] = {}

    class HashingFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            with super().create_stream(path, mode) as raw:
                if "w" not in mode:
                    yield raw
                    return
                stream = _Hashing(raw, new_hasher(), new_hasher)
                yield stream
            streams[str(path)] = stream

        def rename(self, path: Any, new_path: Any) -> None:
            super().rename(path, new_path)
            if str(path) in streams:
                streams[str(new_path)] = streams.pop(str(path))

    writer = FileSystemWriter(folder)
    writer.fs = HashingFileSystem()
    return writer, streams


def reader(source: str | PartFiles) -> Any:
    """torch DCP's reader of a part: a local folder's own, or (`PartFiles`) one that reads
    through storage only the items a load asks for (ranged reads on an object store, the
    items that follow one another in one request), checked against the manifest's pieces
    as they are read."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem

    if isinstance(source, str):
        return FileSystemReader(source)

    class PartFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            if "w" in mode or "a" in mode:
                raise ValueError("a checkpoint part is read, never written, through storage")
            name = os.path.basename(str(path))
            # the metadata is read whole (and kept: each load reads it); an item's bytes
            # are read alone, where DCP slices them (below)
            yield io.BytesIO(source.read(name, keep=True)) if name.endswith(".metadata") \
                else _Unread(name)

        def concat_path(self, path: Any, suffix: str) -> str:
            return f"{path}/{suffix}"

        def init_path(self, path: Any) -> str:
            return str(path)

    class PartReader(FileSystemReader):
        def read_data(self, plan: Any, planner: Any) -> Any:
            # the plan's items read first, items that follow one another in one request
            wanted = [self.storage_data[item.storage_index] for item in plan.items]
            self.fetched = source.read_ranges((i.relative_path, i.offset, i.length)
                                              for i in wanted)
            try:
                return super().read_data(plan, planner)
            finally:
                self.fetched = {}

        def _slice_file(self, file: Any, sinfo: Any) -> Any:
            return io.BytesIO(self.fetched[(sinfo.relative_path, sinfo.offset)])

    out = PartReader(source.folder)
    out.fs, out.path = PartFileSystem(), source.folder
    return out


class _Unread:
    """A data file DCP opens: its items are read range by range, where DCP slices them."""

    def __init__(self, name: str) -> None:
        self.name = name


def load(source: str | PartFiles) -> Any:
    """Reads a DCP checkpoint `save` wrote (a local folder, or a checkpoint's part through
    storage) back into the tree that was saved: tensors with `weights_only=True`, values
    from JSON (unpickled only where `save` had to pickle)."""
    skeleton = _skeleton_of(source)
    template = _template(source, [skeleton])
    return _filled(skeleton, template)


def load_entries(source: str | PartFiles, keys: list[str]) -> dict[str, Any]:
    """The entries `keys` of a part's tree (a dict), with their tensors, read alone: DCP
    reads no other tensor's bytes."""
    skeleton = _skeleton_of(source)
    template = _template(source, [skeleton[k] for k in keys])
    return {k: _filled(skeleton[k], template) for k in keys}


def _skeleton_of(source: str | PartFiles) -> Any:
    """The skeleton of a part `save` wrote, without its tensors."""
    head = {"skeleton": ""}
    _dcp_load(head, source)
    raw = json.loads(head["skeleton"])
    return decode(raw["tree"], allow_pickle=bool(raw["pickled"]))


def _template(source: str | PartFiles, skeletons: list[Any]) -> dict[str, Any]:
    """The tensors the placeholders of `skeletons` stand for, read from the part (only
    theirs: DCP reads no other item's bytes), nested as `save` nested them."""
    metadata = reader(source).read_metadata().state_dict_metadata
    template: dict[str, Any] = {}

    def allocate(path: tuple, _: Any) -> None:
        entry = metadata[".".join(["state", *map(str, path)])]
        node = template
        for key in path[:-1]:
            node = node.setdefault(str(key), {})
        node[str(path[-1])] = torch.empty(entry.size, dtype=entry.properties.dtype)

    for skeleton in skeletons:
        _walk_placeholders(skeleton, allocate)
    if template:
        _dcp_load({"state": template}, source)
    return template


def _dcp_load(state: dict[str, Any], source: str | PartFiles) -> None:
    """torch DCP's load of `state` from the part, raising what storage raised (a
    `CheckpointDamaged`, a `StorageError`) as itself, not wrapped in DCP's exception."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=reader(source), no_dist=True)
    except CheckpointException as exc:
        for failure in exc.failures.values():
            cause = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(cause, RaytrainXError):
                raise cause from None
        raise


def load_shards(source: str | PartFiles, wanted: Callable[[str, int], bool]
                ) -> dict[str, dict[int, Any]]:
    """The optimizer shards of a `shard_<rank>` part that `wanted(optimizer, index)` picks,
    read alone: DCP reads only their tensors' bytes, so a rank never holds the others'."""
    skeleton = _skeleton_of(source)
    chosen = {name: {i: sub for i, sub in states.items() if wanted(name, i)}
              for name, states in skeleton["shards"].items()}
    template = _template(source, [sub for states in chosen.values()
                                  for sub in states.values()])
    return {name: {i: _filled(sub, template) for i, sub in states.items()}
            for name, states in chosen.items()}


def shard_bytes(source: str | PartFiles) -> dict[str, dict[int, int]]:
    """The stored bytes of each optimizer shard (by optimizer and parameter index) of a
    `shard_<rank>` part: what `load_shards` reads for it."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    metadata = reader(source).read_metadata()
    lengths = {index.fqn: info.length for index, info in metadata.storage_data.items()
               if isinstance(index, MetadataIndex)}
    out: dict[str, dict[int, int]] = {}
    for name, states in _skeleton_of(source)["shards"].items():
        for i, sub in states.items():
            paths: list[tuple] = []
            _walk_placeholders(sub, lambda path, _, into=paths: into.append(path))
            out.setdefault(name, {})[i] = sum(
                lengths.get(".".join(["state", *map(str, p)]), 0) for p in paths)
    return out


def _walk_placeholders(skeleton: Any, fn: Callable[[tuple, Any], None]) -> None:
    if isinstance(skeleton, dict) and set(skeleton) == {_AT}:
        fn(tuple(skeleton[_AT]), skeleton)
    elif isinstance(skeleton, dict):
        for value in skeleton.values():
            _walk_placeholders(value, fn)
    elif type(skeleton) in (list, tuple, set, frozenset):
        for value in skeleton:
            _walk_placeholders(value, fn)
