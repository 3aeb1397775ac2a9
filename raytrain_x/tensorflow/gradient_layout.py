"""Which dense tensors the TensorFlow face submits together: its one grouping authority, for
gradients (`DistributedGradientTape`, `DistributedOptimizer`) and `grouped_allreduce`.

A unit is the tensors concatenated into one buffer and submitted as one request, as soon as
they exist (inside `tf.function`, while backward still computes the others). Units follow
from facts known when a function is traced, the same on every rank:

- Horovod's `groups=`: an int k makes k runs of about equal count, in order; lists of
  variables make each list a group and every other gradient a group of its own. No unit
  crosses a group;
- within a group, consecutive tensors of one dtype, last first (backward produces the last
  layers' gradients first), up to `UNIT_BYTES`; a tensor of unknown size is a unit;
- Adasum combines each tensor on its own (its coefficients are per tensor): a unit each.

What crosses the wire in one collective is the engine's to decide at run time: it fuses the
units of a cycle up to the fusion threshold (Horovod's tensor fusion, the knob autotune
moves), which a traced graph cannot follow because its units are fixed when it is traced.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raytrain_x.common.errors import ConfigError
from raytrain_x.core.collectives import Adasum

if TYPE_CHECKING:  # the layout reads shapes and dtypes alone: pure, tested without TensorFlow
    import tensorflow as tf

# Units of about this many bytes: small enough that the first is submitted early in
# backward, large enough that a model's gradients are a few requests.
UNIT_BYTES = 4 << 20


@dataclass(frozen=True)
class Unit:
    """Tensors submitted as one request: their positions in the reduced list, and the
    request's name (the same on every rank).

    Attributes:
        members: positions of the unit's tensors in the list being reduced.
        name: the request's name.
    """

    members: tuple[int, ...]
    name: str


def check_groups(groups: Any, num_groups: int) -> Any:
    """Horovod's `groups=` (an int > 0 or lists of variables) and its deprecated
    `num_groups=`; None when every tensor is in one group."""
    if num_groups:
        warnings.warn("num_groups is deprecated; use groups=", DeprecationWarning,
                      stacklevel=3)
        if groups is None:
            groups = num_groups
    if groups is None or groups == 0:
        return None
    if isinstance(groups, bool) or not (isinstance(groups, int) or
                                        isinstance(groups, (list, tuple))):
        raise ConfigError("groups must be an int > 0 or a list of lists of variables, got "
                          f"{groups!r}")
    if isinstance(groups, int) and groups < 0:
        raise ConfigError(f"groups must be an int > 0 or a list of lists of variables, got "
                          f"{groups}")
    return groups


def ref(source: Any) -> Any:
    """A hashable key for a variable or tensor (TensorFlow's `.ref()`)."""
    return source.ref() if hasattr(source, "ref") else id(source)


def units(tensors: Sequence[tf.Tensor], name: str, op: str, groups: Any = None,
          sources: Sequence[Any] | None = None) -> list[Unit]:
    """The units `tensors` are submitted in (module docstring); `sources` are the
    variables of gradients, needed when `groups` lists variables."""
    if not tensors:
        return []
    grouped = _groups(len(tensors), groups, sources)
    out: list[Unit] = []
    for g, group in enumerate(grouped):
        base = name if len(grouped) == 1 else f"{name}.group{g}"
        # positions within the group
        cut = ([[p] for p in reversed(range(len(group)))] if op == Adasum
               else _by_bytes([tensors[i] for i in group]))
        for k, positions in enumerate(cut):
            out.append(Unit(tuple(group[p] for p in positions),
                            base if len(cut) == 1 else f"{base}.{k}"))
    return out


def _groups(count: int, groups: Any, sources: Sequence[Any] | None) -> list[list[int]]:
    """Positions 0..count-1 split by Horovod's `groups=`, each group in order."""
    everything = list(range(count))
    if groups is None:
        return [everything]
    if isinstance(groups, int):
        k = min(groups, count)
        per, extra = divmod(count, k)
        out, start = [], 0
        for j in range(k):
            end = start + per + (1 if j < extra else 0)
            out.append(everything[start:end])
            start = end
        return out
    if sources is None:
        raise ConfigError("groups= lists of variables need the gradients' variables; "
                          "use an int for groups here")
    position = {ref(s): i for i, s in enumerate(sources)}
    out, taken = [], set()
    for group in groups:
        members = sorted({position[ref(v)] for v in group if ref(v) in position} - taken)
        taken.update(members)
        if members:
            out.append(members)
    return out + [[i] for i in everything if i not in taken]


def _by_bytes(tensors: Sequence[tf.Tensor]) -> list[list[int]]:
    """Consecutive same-dtype tensors, last first, up to `UNIT_BYTES` each; a tensor of
    unknown size on its own."""
    cut: list[list[int]] = []
    used = 0
    for i in reversed(range(len(tensors))):
        t = tensors[i]
        known = t.shape.is_fully_defined()
        nbytes = t.shape.num_elements() * t.dtype.size if known else UNIT_BYTES
        if cut and known and t.dtype == tensors[cut[-1][0]].dtype \
                and used + nbytes <= UNIT_BYTES:
            cut[-1].append(i)
            used += nbytes
        else:
            cut.append([i])
            used = nbytes
    return cut
