"""The public names of a package: a framework face's `__all__`, and packages whose names
load when first asked for."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


def public_names(namespace: dict[str, Any], modules: tuple[str, ...] = ("elastic",)) -> list[str]:
    """Every function, class and constant in `namespace`, and of its submodules only
    `modules`, the ones Horovod users reach by attribute (`hvd.elastic`); not the face's
    internal modules, nor `annotations` from a `__future__` import."""
    return sorted(name for name, value in namespace.items()
                  if not name.startswith("_") and name != "annotations"
                  and (not isinstance(value, ModuleType) or name in modules))


def lazy_names(package: str, homes: dict[str, str | None]
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's module `__getattr__` and `__dir__` (PEP 562) that import each public name
    from its home module when it is first asked for, and keep it: importing the package
    imports none of them. `homes` maps a name to its module's full path; None: the name is
    the package's submodule of that name."""

    def getattr_(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        home = homes[name]
        value = (importlib.import_module(f"{package}.{name}") if home is None
                 else getattr(importlib.import_module(home), name))
        setattr(sys.modules[package], name, value)
        return value

    def dir_() -> list[str]:
        return sorted(homes)

    return getattr_, dir_
