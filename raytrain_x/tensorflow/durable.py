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
The commit manager (`raytrain_x.elastic.commits`) writes and reads the part through
`raytrain_x.tensorflow.elastic.TensorFlowFormat`.
"""

from __future__ import annotations

import json
import os
import pickle
from typing import Any

import numpy as np
import tensorflow as tf

from raytrain_x.common.errors import ConfigError

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
