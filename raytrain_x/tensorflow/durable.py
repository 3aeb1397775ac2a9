"""Durable checkpoints of a `TensorFlowState` (and a Keras state): its committed host values
written to storage by rank 0's background thread in `tf.train.Checkpoint` format, and
read back.

A checkpoint has one part, `common`: a `tf.train.Checkpoint` whose `variables` are the
state's variables by their paths (`dense/kernel`, `adam/iteration`; `_2`, `_3` after a
path seen before), written to the prefix `state` in the part's folder, and beside it
`attributes.json` (the plain attributes and the variables' order; `attributes.pkl`, a
pickle, only where an attribute is not plain JSON: docs/security.md). Plain TensorFlow reads
it with `tf.train.load_checkpoint(".../common.<id>/state")`, or restores the same variables
with `tf.train.Checkpoint(variables=dict(zip(keys, variables))).read(...)`.
The writer, the manifest and the restore decision are `raytrain_x.elastic.durable`'s.
"""

from __future__ import annotations

import json
import os
import pickle
import time
from typing import Any

import numpy as np
import tensorflow as tf

from raytrain_x.common.checkpoint_config import CheckpointConfig
from raytrain_x.common.errors import ConfigError
from raytrain_x.core import runtime
from raytrain_x.core.objects import broadcast_object
from raytrain_x.elastic.checkpoints import Manifest
from raytrain_x.elastic.durable import (
    COMMON,
    DurableCheckpoints,
    checkpoint_to_restore,
    new_manifest,
    part_kind,
    part_name,
    plain_values,
    restored,
)

PREFIX = "state"  # the tf.train.Checkpoint's prefix in a part's folder
ATTRIBUTES = "attributes.json"
PICKLED = "attributes.pkl"  # attributes JSON cannot hold (unpickled only where written)


def variable_keys(variables: list[Any]) -> list[str]:
    """Each variable's name in a checkpoint: its path (Keras) or name, made unique."""
    seen: dict[str, int] = {}
    keys = []
    for var in variables:
        key = str(getattr(var, "path", None) or var.name).removesuffix(":0")
        seen[key] = seen.get(key, 0) + 1
        keys.append(key if seen[key] == 1 else f"{key}_{seen[key]}")
    return keys


def save(tree: dict[str, Any], folder: str) -> None:
    """Writes a committed state (`keys`, `values`, `attributes`) to `folder`."""
    os.makedirs(folder, exist_ok=True)
    with tf.device("/cpu:0"):
        variables = {k: tf.Variable(v, trainable=False)
                     for k, v in zip(tree["keys"], tree["values"])}
    tf.train.Checkpoint(variables=variables).write(os.path.join(folder, PREFIX))
    saved = {"keys": tree["keys"], "attributes": tree["attributes"]}
    try:
        text = json.dumps(saved, allow_nan=True)
        if json.loads(text) != saved:  # tuples, int keys: JSON would change them
            raise TypeError("not plain JSON")
        with open(os.path.join(folder, ATTRIBUTES), "w") as f:
            f.write(text)
    except (TypeError, ValueError):
        with open(os.path.join(folder, PICKLED), "wb") as f:
            pickle.dump(saved, f)


def load(folder: str) -> dict[str, Any]:
    """Reads what `save` wrote: `keys`, `values` (numpy, in the saved order), `attributes`."""
    if os.path.exists(os.path.join(folder, ATTRIBUTES)):
        with open(os.path.join(folder, ATTRIBUTES)) as f:
            saved = json.load(f)
    else:
        with open(os.path.join(folder, PICKLED), "rb") as f:
            saved = pickle.load(f)
    reader = tf.train.load_checkpoint(os.path.join(folder, PREFIX))
    by_key = _read_by_key(reader, saved["keys"])
    return {"keys": saved["keys"], "values": [by_key[k] for k in saved["keys"]],
            "attributes": saved["attributes"]}


def _read_by_key(reader: Any, keys: list[str]) -> dict[str, np.ndarray]:
    """The tensors of `keys` from a checkpoint reader, through the checkpoint's object
    graph (its own escaping of `/` and `.` in names)."""
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    root = graph.nodes[0]
    variables = next(c.node_id for c in root.children if c.local_name == "variables")
    out = {}
    for child in graph.nodes[variables].children:
        node = graph.nodes[child.node_id]
        attribute = next(a for a in node.attributes if a.name == "VARIABLE_VALUE")
        out[child.local_name] = reader.get_tensor(attribute.checkpoint_key)
    missing = [k for k in keys if k not in out]
    if missing:
        raise ConfigError(f"the checkpoint has no values for {missing[:5]}: it was written "
                          "by a state with other variables")
    return out


def open_checkpoints(config: CheckpointConfig) -> DurableCheckpoints:
    """A TensorFlow state's durable checkpoints: one part in `tf.train.Checkpoint` format."""
    return DurableCheckpoints(config, save, load)


def signature(state: Any) -> dict[str, Any]:
    """What a TensorFlow state is, as a manifest records it: each variable's shape and
    dtype by its key, the attributes' names."""
    out: dict[str, Any] = {key: [list(var.shape), getattr(var.dtype, "name", str(var.dtype))]
                           for key, var in zip(variable_keys(state.variables), state.variables)}
    out["attributes"] = sorted(state._names)
    return out


def write_parts(durable: DurableCheckpoints, state: Any, write_id: int,
                background: bool = True) -> Manifest | None:
    """Starts writing `state`'s commit just taken: rank 0 writes the one part (and, in the
    background, the manifest; else it returns the manifest to complete); the other ranks
    hold the same values and write nothing."""
    if runtime.rank() != 0:
        return None
    common = part_name(COMMON, write_id)
    tree = {"keys": variable_keys(state.variables), "values": state._saved_values,
            "attributes": state._saved}
    manifest = new_manifest(durable, runtime.size(), plain_values(state._saved),
                            {"layout": "tensorflow"}, signature(state))
    durable.write({common: lambda: tree}, manifest, [common] if background else None)
    return manifest


def restore_from_storage(durable: DurableCheckpoints, state: Any) -> bool:
    """At a sync where no rank holds the state in memory: rank 0 loads the latest complete
    checkpoint into the state's variables and attributes (the sync then broadcasts them).
    Returns False (and loads nothing) when some rank holds the state or there is none."""
    manifest = checkpoint_to_restore(durable, broadcast_object, signature(state))
    if manifest is None:
        return False
    began = time.perf_counter()
    if runtime.rank() == 0:
        common = next(p for p in manifest.parts if part_kind(p) == COMMON)
        tree = durable.load(manifest, common)
        keys = variable_keys(state.variables)
        if tree["keys"] != keys:
            other = sorted(set(tree["keys"]) ^ set(keys))[:3] or "their order"
            raise ConfigError(f"checkpoint {manifest.number} holds other variables than "
                              f"this state ({len(tree['keys'])} saved, {len(keys)} here; "
                              f"they differ in {other}): restore it into the model and "
                              "optimizer it was written from")
        for var, value in zip(state.variables, tree["values"]):
            var.assign(value)
        for name, value in tree["attributes"].items():
            setattr(state, name, value)
    restored(durable, state, manifest, began)
    return True
