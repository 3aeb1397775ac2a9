"""`rx.elastic`: elastic training for TensorFlow and Keras (Horovod's `hvd.elastic`).

States commit by copying variable values to host memory, restore by assigning them back,
and sync by broadcasting rank 0's variables, through their commit manager
(`raytrain_x.elastic.commits`) and the format below. `run` is the core's, with one addition:
TensorFlow reports an error raised inside a graph as a `tf.errors.OpError`, so the
raytrain-x error behind it (a lost peer, a reset) is raised again in its own type first.
"""

from __future__ import annotations

import copy
import functools
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from raytrain_x.common.checkpoint_config import CheckpointConfig, from_env
from raytrain_x.common.errors import ConfigError
from raytrain_x.core.runtime import rank
from raytrain_x.elastic.checksums import PartFiles
from raytrain_x.elastic.commits import CommitManager, Committed, copied
from raytrain_x.elastic.state import Attributes, ObjectState, State, restore_count
from raytrain_x.elastic.state import run as _run
from raytrain_x.tensorflow.arrays import unwrap_error
from raytrain_x.tensorflow.durable import load, save, variable_keys
from raytrain_x.tensorflow.functions import broadcast_object, broadcast_variables


class TensorFlowFormat:
    """The format of a `TensorFlowState` (`raytrain_x.elastic.commits.Format`): its
    variables' values copied to host memory and its plain attributes deep-copied; a part
    in `tf.train.Checkpoint` format (`raytrain_x.tensorflow.durable`)."""

    layout = "tensorflow"
    info: dict[str, Any] = {}

    def __init__(self, owner: Any, variables: list[Any], names: list[str],
                 local_steps: list[Any] | None = None) -> None:
        self.variables, self.names = variables, names
        # LocalSGD / DiLoCo states whose trained variables each rank keeps between
        # exchanges: at a sync each decides whether a rank keeps its own (`sync_params`)
        self.local_steps = local_steps or []
        self.keys = variable_keys(variables)
        self.attributes = Attributes(owner, names, broadcast_object)

    def values(self) -> dict[str, Any]:
        return self.attributes.values()

    def take(self) -> Committed:
        tree = {"keys": list(self.keys),
                "values": [np.array(v.numpy(), copy=True) for v in self.variables],
                "attributes": copy.deepcopy(self.values())}
        return copied(tree, _copy_tree)

    def load(self, tree: dict[str, Any]) -> None:
        keys = self.keys
        if tree["keys"] != keys:
            other = sorted(set(tree["keys"]) ^ set(keys))[:3] or "their order"
            raise ConfigError(f"the checkpoint holds other variables than this state "
                              f"({len(tree['keys'])} saved, {len(keys)} here; they differ "
                              f"in {other}): restore it into the model and optimizer it "
                              "was written from")
        for var, value in zip(self.variables, tree["values"]):
            var.assign(value)
        self.attributes.load(tree["attributes"])

    def sync_from(self, root: int) -> None:
        kept = [(steps, steps.lineage(), steps.own_values()) for steps in self.local_steps]
        # a LocalSGD / DiLoCo model's trained variables are each rank's own once rank 0
        # has an anchor: they cross only when it has none (`sync_params`)
        each_own = {id(v) for steps in self.local_steps for v in steps.exchanged()}
        if self.variables:
            broadcast_variables([v for v in self.variables if id(v) not in each_own],
                                root_rank=root)
        roots = [v for steps, lineage, own in kept if steps.sync_params(lineage, own)
                 for v in steps.exchanged()]
        if roots:
            broadcast_variables(roots, root_rank=root)
        self.attributes.sync_from(root)

    def signature(self) -> dict[str, Any]:
        """Each variable's shape and dtype by its key, the attributes' names."""
        out: dict[str, Any] = {key: [list(var.shape), getattr(var.dtype, "name", str(var.dtype))]
                               for key, var in zip(self.keys, self.variables)}
        return {**out, **self.attributes.signature()}

    def save(self, tree: Any, folder: str) -> None:
        save(tree, folder)

    def read(self, part: PartFiles) -> Any:
        # a checked copy: a folder read in place could change between check and read
        with tempfile.TemporaryDirectory(prefix="raytrain-x-restore-") as tmp:
            return load(part.copy_to(tmp))


def _copy_tree(tree: dict[str, Any]) -> dict[str, Any]:
    return {"keys": list(tree["keys"]), "values": [v.copy() for v in tree["values"]],
            "attributes": copy.deepcopy(tree["attributes"])}


class TensorFlowState(ObjectState):
    """A list of variables and any plain attributes (epoch, batch, ...).

    Args:
        variables: the `tf.Variable`s committed, restored and synced (e.g.
            `model.variables + optimizer.variables`).
        checkpoint: durable checkpoints of the commits (`CheckpointConfig`), written by
            rank 0 in the background in `tf.train.Checkpoint` format and restored when no
            worker holds the state (default: the one `RayExecutor(checkpoint=...)` or
            `raytrain-x run --checkpoint-path` gives, else none).
        **kwargs: plain attributes, as in `ObjectState`.
    """

    def __init__(self, variables: Iterable[Any] | None = None, *,
                 checkpoint: CheckpointConfig | None = None, **kwargs: Any) -> None:
        self.variables = list(variables or [])
        self._config = checkpoint.named(None) if checkpoint else from_env()
        self._format = TensorFlowFormat(self, self.variables, list(kwargs),
                                        self._local_steps())
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def _commit_manager(self) -> CommitManager:
        return CommitManager(self._format, broadcast_object, self._config)

    def _local_steps(self) -> list[Any]:
        """The LocalSGD / DiLoCo states among this state's optimizers."""
        return []


class TensorFlowKerasState(TensorFlowState):
    """A Keras model, its optimizer and plain attributes.

    The optimizer's variables are created here when it has none yet, so that a worker
    that joins a running job holds the same variables as rank 0 before the first sync.

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default: `model.optimizer`).
        **kwargs: `checkpoint=` and plain attributes, as in `TensorFlowState`.
    """

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer",
                                                                         None)
        if self.optimizer is not None and not self.optimizer.built:
            self.optimizer.build(model.trainable_variables)
        variables = list(model.variables)
        if self.optimizer is not None:
            variables += list(self.optimizer.variables)
        super().__init__(variables, **kwargs)

    def _local_steps(self) -> list[Any]:
        """The optimizer's LocalSGD or DiLoCo: a rank that was in the job keeps its own
        trained variables at a sync, a newcomer takes the anchor."""
        steps = getattr(self.optimizer, "_rx_steps", None)
        return [steps] if steps is not None else []


KerasState = TensorFlowKerasState  # Horovod's name in horovod.tensorflow.keras.elastic


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Makes `func(state, *args, **kwargs)` elastic (see `raytrain_x.elastic.run`)."""

    @functools.wraps(func)
    def unwrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            original = unwrap_error(exc)
            if original is exc:
                raise
            raise original from exc

    return _run(unwrapped)


__all__ = ["KerasState", "ObjectState", "State", "TensorFlowKerasState", "TensorFlowState",
           "restore_count", "run"]
