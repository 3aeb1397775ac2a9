"""MkDocs hooks: the API reference pages, generated from the public names of each module.

Each page lists what the module's `__all__` names (imported here, so the list is the one
users get): constants, classes, functions, submodules. mkdocstrings renders each object
from its docstring once, on its home page: what every face shares (defined in the core)
on the shared page, what the TensorFlow face shares with the Keras one on the TensorFlow
page; the other pages link there.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.reference")
SHARED = "raytrain_x"
# the modules of the reference, with what each one is for; a page's objects are those
# defined under its `home` package (the shared page: those defined under no face)
MODULES = {
    "raytrain_x.torch": "Horovod's PyTorch API (`import raytrain_x.torch as hvd`).",
    "raytrain_x.tensorflow": "Horovod's TensorFlow API (`import raytrain_x.tensorflow as hvd`).",
    "raytrain_x.tensorflow.keras": "Horovod's Keras API (`import raytrain_x.tensorflow.keras as "
                                   "hvd`; `raytrain_x.keras` is the same for `horovod.keras`).",
    "raytrain_x.ray": "Starting workers on Ray: `RayExecutor`.",
    "raytrain_x.ray.train": "Ray Train v2: `RaytrainXTrainer` and Horovod's `HorovodTrainer`.",
    "raytrain_x.tune_integration": "Ray Tune: distributed trials and autotune experiments.",
    "raytrain_x.torch.workloads": "Benchmark workloads in plain torch (no torchvision, no "
                                  "downloads): ResNet-18, a GPT decoder, a model of given "
                                  "parameter shapes, synthetic batches.",
    "raytrain_x.tensorflow.workloads": "The same workloads in Keras.",
}


def page_name(module: str) -> str:
    return f"reference/{module}.md"


def _kind(value: Any) -> str:
    if inspect.ismodule(value):
        return "Submodules"
    if inspect.isclass(value):
        return "Classes"
    return "Functions" if callable(value) else "Constants"


def _home(value: Any) -> str:
    """The page an object is rendered on."""
    defined = value.__module__
    homes = [m for m in MODULES if defined == m or defined.startswith(m + ".")]
    if homes:
        return max(homes, key=len)
    return SHARED if defined.startswith(SHARED + ".") else ""


def _public(module: str) -> list[tuple[str, Any]]:
    mod = importlib.import_module(module)
    return [(name, getattr(mod, name)) for name in mod.__all__]


def _render(value: Any) -> list[str]:
    # from where it is defined: the faces re-export, and a star import's computed
    # `__all__` is not something a static reader can follow
    return [f"::: {_identifier(value)}", "    options:", "      heading_level: 3", ""]


def _identifier(value: Any) -> str:
    return f"{value.__module__}.{value.__qualname__}"


def _objects_section(names: list[tuple[str, Any]], here: str) -> list[str]:
    lines: list[str] = []
    for kind in ("Classes", "Functions"):
        items = [(n, v) for n, v in names if _kind(v) == kind]
        if not items:
            continue
        rendered = [(n, v) for n, v in items if _home(v) == here and v.__name__ == n]
        linked = [(n, v) for n, v in items if (n, v) not in rendered]
        lines += [f"## {kind}", ""]
        if linked:
            lines += ["| name | documented |", "|---|---|"]
            for n, v in linked:
                where = "the shared names" if _home(v) == SHARED else f"`{_home(v)}`"
                alias = "" if v.__name__ == n else f" (Horovod's name for `{v.__name__}`)"
                lines.append(f"| `{n}`{alias} | [{where}][{_identifier(v)}] |")
            lines.append("")
        for _, v in rendered:
            lines += _render(v)
    return lines


def shared_page() -> str:
    seen: dict[str, Any] = {}
    for face in ("raytrain_x.torch", "raytrain_x.tensorflow"):
        for _name, value in _public(face):
            if _kind(value) in ("Classes", "Functions") and _home(value) == SHARED:
                seen.setdefault(_identifier(value), value)
    lines = ["# Shared by every face", "",
             "Functions and classes that `raytrain_x.torch`, `raytrain_x.tensorflow` and "
             "`raytrain_x.tensorflow.keras` all export: initialisation, ranks and sizes, "
             "process sets, the timeline, knobs, and the errors.", ""]
    for kind in ("Classes", "Functions"):
        values = [v for v in seen.values() if _kind(v) == kind]
        if values:
            lines += [f"## {kind}", ""]
            for v in sorted(values, key=lambda v: v.__name__.lower()):
                lines += _render(v)
    return "\n".join(lines)


def page(module: str) -> str:
    names = _public(module)
    lines = [f"# `{module}`", "", MODULES[module], ""]
    constants = [(n, v) for n, v in names if _kind(v) == "Constants"]
    if constants:
        lines += ["## Constants", "", "| name | value |", "|---|---|"]
        lines += [f"| `{n}` | `{v!r}` |" for n, v in constants]
        lines.append("")
    lines += _objects_section(names, module)
    for name, value in names:
        if _kind(value) != "Submodules":
            continue
        lines += [f"## `{module}.{name}`", ""]
        if value.__name__.startswith(module + "."):
            lines += [f"::: {value.__name__}", "    options:", "      heading_level: 3",
                      "      show_root_heading: false", "      show_root_toc_entry: false", ""]
        else:
            lines += [f"The same module as `{value.__name__}`.", ""]
    return "\n".join(lines)


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, "reference/shared.md", content=shared_page()))
    for module in MODULES:
        files.append(File.generated(config, page_name(module), content=page(module)))
    return files


def on_pre_build(config: Any) -> None:
    """Every public class and function of the reference has a docstring: the reference is
    read as the reference, and mkdocstrings would render a bare signature silently."""
    missing, no_args = [], []
    for module in MODULES:
        for name, value in _public(module):
            if _kind(value) not in ("Classes", "Functions"):
                continue
            doc = inspect.getdoc(value)
            if not doc:
                missing.append(f"{module}.{name}")
            elif _parameters(value) and not ("Args:" in doc or "Attributes:" in doc):
                no_args.append(f"{module}.{name}")
    if missing:
        log.warning("public names without a docstring: %s", ", ".join(sorted(set(missing))))
    if no_args:
        log.warning("public names whose docstring has no Args (or Attributes) section: %s",
                    ", ".join(sorted(set(no_args))))


def _parameters(value: Any) -> list[str]:
    """The parameters a caller passes (a class's: its constructor's)."""
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):
        return []
    return [p for p in signature.parameters if p not in ("self", "args", "kwargs")]
