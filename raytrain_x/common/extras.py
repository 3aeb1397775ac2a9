"""Optional dependencies: a missing one is a `ConfigError` that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

from raytrain_x.common.errors import ConfigError


def import_extra(module: str, extra: str, purpose: str) -> ModuleType:
    """Imports `module`; if it, or something it needs, is not installed, raises a
    ConfigError saying that `purpose` needs the `extra` extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = exc.name or module
        raise ConfigError(f"{purpose} needs {missing}, which is not installed; it comes with "
                          f"the {extra!r} extra: pip install \"raytrain-x[{extra}]\"") from exc
