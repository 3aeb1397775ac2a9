"""The TensorFlow face's one grouping authority (`tensorflow/gradient_layout.py`): the units
its dense tensors are submitted in, from Horovod's groups, dtypes, sizes and the op. Pure
logic over shapes and dtypes: the tensors are stand-ins with TensorFlow's shape and dtype
methods.

The module is loaded from its file, not through its package: `raytrain_x.tensorflow` imports
TensorFlow (about 4 s of CPU), and every suite process collects this file."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import raytrain_x
from raytrain_x.common.errors import ConfigError
from raytrain_x.core.collectives import Adasum, Average


def _load_layout():
    path = Path(raytrain_x.__file__).parent / "tensorflow" / "gradient_layout.py"
    spec = importlib.util.spec_from_file_location("tf_gradient_layout_alone", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_layout = _load_layout()
UNIT_BYTES, check_groups, units = _layout.UNIT_BYTES, _layout.check_groups, _layout.units

QUARTER = UNIT_BYTES // 4 // 4  # float32 elements in a quarter of a unit


@dataclass(frozen=True)
class DType:
    name: str
    size: int


@dataclass(frozen=True)
class Shape:
    elements: int | None

    def is_fully_defined(self) -> bool:
        return self.elements is not None

    def num_elements(self) -> int | None:
        return self.elements


@dataclass(frozen=True)
class Spec:
    shape: Shape
    dtype: DType


FLOAT32, FLOAT64 = DType("float32", 4), DType("float64", 8)


def spec(elements: int | None, dtype: DType = FLOAT32) -> Spec:
    return Spec(Shape(elements), dtype)


class Variable:
    """A variable's stand-in: keyed by identity, as `ref()` keys one."""


def members(cut):
    return [list(u.members) for u in cut]


def test_units_are_runs_of_one_dtype_last_first_up_to_the_unit_size():
    tensors = [spec(QUARTER)] * 6
    assert members(units(tensors, "g", Average)) == [[5, 4, 3, 2], [1, 0]]
    mixed = [spec(10), spec(10, FLOAT64), spec(10, FLOAT64), spec(None), spec(10)]
    assert members(units(mixed, "g", Average)) == [[4], [3], [2, 1], [0]]
    assert [u.name for u in units(mixed, "g", Average)] == ["g.0", "g.1", "g.2", "g.3"]
    assert [u.name for u in units([spec(3)], "g", Average)] == ["g"]


def test_adasum_makes_a_unit_of_each_tensor():
    assert members(units([spec(3)] * 3, "g", Adasum)) == [[2], [1], [0]]


def test_an_int_makes_that_many_groups_of_about_equal_count_and_no_unit_crosses_one():
    cut = units([spec(3)] * 5, "g", Average, groups=2)
    assert members(cut) == [[2, 1, 0], [4, 3]]
    assert [u.name for u in cut] == ["g.group0", "g.group1"]
    assert members(units([spec(3)] * 2, "g", Average, groups=5)) == [[0], [1]]


def test_lists_of_variables_make_groups_and_every_other_gradient_its_own():
    sources = [Variable() for _ in range(4)]
    cut = units([spec(1)] * 4, "g", Average, groups=[[sources[3], sources[0]], [sources[1]]],
                sources=sources)
    assert members(cut) == [[3, 0], [1], [2]]
    with pytest.raises(ConfigError, match="use an int"):
        units([spec(1)], "g", Average, groups=[[sources[0]]])


def test_groups_are_checked_and_num_groups_is_deprecated():
    assert check_groups(None, 0) is None and check_groups(0, 0) is None
    with pytest.warns(DeprecationWarning):
        assert check_groups(None, 3) == 3
    for bad in (-1, True, "two"):
        with pytest.raises(ConfigError, match="groups must be"):
            check_groups(bad, 0)
