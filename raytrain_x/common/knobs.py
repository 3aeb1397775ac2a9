"""The communication knobs: what autotune moves, and how it searches each.

Each knob's variable, flag, config key, default and range are its setting's
(`raytrain_x.common.settings`). Flags, environment variables, config files and the
autotuner all read and write `Knobs`.
Precedence when resolving: flag > env > config file > default.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from raytrain_x.common import settings, training
from raytrain_x.common.errors import ConfigError
from raytrain_x.common.settings import MB, Setting


@dataclass(frozen=True)
class SearchScale:
    """How the autotune search sees a knob: a continuous coordinate `x` in [lo, hi].

    A numeric knob is `base ** x` (rounded to a multiple of `quantum`, or to `digits`
    decimals), and 0 (off) for `x < off_below`; a switch (`base` 0) is on for `x >= 0.5`.
    """

    base: float  # 2 or 10: a log scale; 0: an on/off switch
    lo: float
    hi: float
    off_below: float | None = None
    quantum: float | None = None
    digits: int | None = None

    def value(self, x: float) -> Any:
        """The knob's value at coordinate `x`."""
        if not self.base:
            return x >= 0.5
        if self.off_below is not None and x < self.off_below:
            return 0
        v = self.base ** x
        if self.quantum is not None:
            return int(round(v / self.quantum) * self.quantum)
        return round(v, self.digits) if self.digits is not None else v

    def coordinate(self, value: Any) -> float:
        """`value`'s coordinate, clipped into [lo, hi] (off is `lo`)."""
        if not self.base:
            x = 1.0 if value else 0.0
        else:
            log = {2: math.log2, 10: math.log10}.get(self.base) or \
                (lambda v: math.log(v, self.base))
            x = log(value) if value > 0 else self.lo
        return min(max(x, self.lo), self.hi)


@dataclass(frozen=True)
class KnobSpec:
    """How one knob is searched, and its setting (`raytrain_x.common.settings`): its
    variable, flag, config key, range and meaning."""

    var: Setting
    search: SearchScale | None = None

    @property
    def env(self) -> str:
        return self.var.env

    @property
    def flag(self) -> str:
        return self.var.flag or ""

    @property
    def lo(self) -> float:
        return 0 if self.var.kind is bool else self.var.minimum

    @property
    def hi(self) -> float:
        return 1 if self.var.kind is bool else self.var.maximum

    @property
    def kind(self) -> type:
        return self.var.kind

    @property
    def help(self) -> str:
        return self.var.doc

    @property
    def flag_scale(self) -> int:
        """The flag and the config alias may use another unit (MB for the fusion
        threshold)."""
        return self.var.flag_scale

    @property
    def alias(self) -> str | None:
        """The config key in the flag's unit (`fusion_threshold_mb`)."""
        return "fusion_threshold_mb" if self.var.flag_scale == MB else None


def _knob(var: Setting, search: SearchScale) -> Any:
    return field(default=var.default, metadata={"spec": KnobSpec(var, search)})


@dataclass(frozen=True)
class Knobs:
    """Every tunable communication setting.

    Attributes:
        fusion_threshold_bytes: the largest batch reduced at once, in bytes: the runs of
            gradients `DistributedOptimizer` cuts (unless `bucket_cap_mb` fixes buckets),
            or per-tensor requests fused while ready in the same cycle; 0: nothing
            fused.
        cycle_time_ms: pause between engine cycles in milliseconds while work keeps
            arriving (a request reaching an idle engine starts a cycle at once).
        cache_capacity: response-cache entries; 0 turns the cache off.
        hierarchical_allreduce: local sum, cross allreduce of one shard per local rank,
            local allgather; takes effect where the world has several hosts with several
            workers each and every host's workers share memory (host-memory arrays).
        hierarchical_allgather: two-level allgather (local, then cross).
    """

    # 1 MiB .. 256 MiB, in quarter MiBs; below 2^20 "0" (nothing fused): runs of
    # `DistributedOptimizer` under 1 MiB only add poor points to explore.
    fusion_threshold_bytes: int = _knob(
        settings.FUSION_THRESHOLD, SearchScale(2, 19.0, 28.0, off_below=20.0, quantum=MB / 4))
    cycle_time_ms: float = _knob(  # 0.1 .. 25 ms
        settings.CYCLE_TIME, SearchScale(10, -1.0, math.log10(25.0), digits=3))
    cache_capacity: int = _knob(  # off, 1 .. 4096
        settings.CACHE_CAPACITY, SearchScale(2, -1.0, 12.0, off_below=0.0, quantum=1))
    hierarchical_allreduce: bool = _knob(
        settings.HIERARCHICAL_ALLREDUCE, SearchScale(0, 0.0, 1.0))
    hierarchical_allgather: bool = _knob(
        settings.HIERARCHICAL_ALLGATHER, SearchScale(0, 0.0, 1.0))

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            spec: KnobSpec = f.metadata["spec"]
            value = getattr(self, f.name)
            if spec.kind is bool:
                if not isinstance(value, bool):
                    raise ConfigError(f"knob {f.name} must be true or false, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"knob {f.name} must be a number, got {value!r}")
            if spec.kind is int and value != int(value):
                raise ConfigError(f"knob {f.name} must be a whole number, got {value!r}")
            if not (math.isfinite(value) and spec.lo <= value <= spec.hi):
                raise ConfigError(
                    f"knob {f.name}={value!r} is out of range; allowed {spec.lo:g}..{spec.hi:g}"
                )
            object.__setattr__(self, f.name, spec.kind(value))

    @staticmethod
    def specs() -> dict[str, KnobSpec]:
        """Knob name -> its spec, in declaration order."""
        return {f.name: f.metadata["spec"] for f in dataclasses.fields(Knobs)}

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of knob values (JSON-friendly)."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> Knobs:
        """A copy with some knobs changed (validated)."""
        unknown = set(changes) - set(self.specs())
        if unknown:
            raise ConfigError(f"unknown knob(s) {sorted(unknown)}; known: {sorted(self.specs())}")
        return dataclasses.replace(self, **changes)


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, spec in Knobs.specs().items():
        raw = spec.var.raw(env)
        if raw is not None:
            out[name] = spec.var.parse(raw, f"environment {spec.env}")
    return out


def _config_settings(path: str | os.PathLike) -> dict[str, Any]:
    """The settings a YAML or JSON config file holds: at top level, under `params:`
    (Horovod's layout) or under `config:` (the `best_config.json` that
    `autotune_experiments` writes)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist; pass an existing YAML/JSON file")
    text = p.read_text()
    try:
        data = json.loads(text) if p.suffix.lower() == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {str(p)!r} could not be parsed: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of knob names to values")
    for key in ("params", "config"):
        if isinstance(data.get(key), dict):
            return data[key]
    return data


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Reads knobs from a YAML or JSON file: knob names (or `fusion_threshold_mb`) at top
    level or under `params:` (Horovod's layout). Returns knob name -> value."""
    specs = Knobs.specs()
    aliases = {spec.alias: name for name, spec in specs.items() if spec.alias}
    out: dict[str, Any] = {}
    for key, raw in _config_settings(path).items():
        key_norm = str(key).replace("-", "_")
        source = f"config file {str(path)!r} key {key!r}"
        if key_norm in training.ENV:  # not a knob: `read_training_settings` reads it
            continue
        if key_norm in specs:
            out[key_norm] = specs[key_norm].var.parse(raw, source)
        elif key_norm in aliases:
            name = aliases[key_norm]
            out[name] = specs[name].var.parse_scaled(raw, source)
        else:
            known = sorted(list(specs) + list(aliases))
            raise ConfigError(f"{source} is not a knob; known keys: {', '.join(known)}")
    return out


def read_training_settings(path: str | os.PathLike) -> dict[str, int]:
    """The training settings (`raytrain_x.common.training`) of a YAML or JSON config file."""
    return training.from_mapping(_config_settings(path), f"config file {str(path)!r}")


def load_knobs(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | os.PathLike | None = None,
    base: Knobs | None = None,
) -> tuple[Knobs, frozenset[str]]:
    """Resolves knobs with precedence flag > env > config file > `base` (default `Knobs()`).

    Args:
        flags: knob name -> value in its flag's unit (MB for bytes).
        env: environment to read `RAYTRAIN_X_*` from; `os.environ` when None.
        config_file: optional YAML/JSON file of knobs.
        base: starting values (defaults when None).

    Returns:
        The knobs and the names the user fixed explicitly (left out of autotuning).

    Raises:
        ConfigError: a value is malformed, unknown or out of range.
    """
    values: dict[str, Any] = {}
    if config_file:
        values.update(read_config_file(config_file))
    values.update(_from_env(os.environ if env is None else env))
    specs = Knobs.specs()
    for name, value in (flags or {}).items():
        if name not in specs:
            raise ConfigError(f"unknown knob {name!r}; known: {', '.join(specs)}")
        if value is not None:
            values[name] = specs[name].var.parse_scaled(value, f"flag {specs[name].flag}")
    knobs = (base or Knobs()).replace(**values)
    return knobs, frozenset(values)
