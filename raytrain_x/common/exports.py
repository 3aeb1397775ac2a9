"""The public names of a framework face, for its `__all__`."""

from __future__ import annotations

from types import ModuleType
from typing import Any


def public_names(namespace: dict[str, Any], modules: tuple[str, ...] = ("elastic",)) -> list[str]:
    """Every function, class and constant in `namespace`, and of its submodules only
    `modules`, the ones Horovod users reach by attribute (`hvd.elastic`); not the face's
    internal modules, nor `annotations` from a `__future__` import."""
    return sorted(name for name, value in namespace.items()
                  if not name.startswith("_") and name != "annotations"
                  and (not isinstance(value, ModuleType) or name in modules))
