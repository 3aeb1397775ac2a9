# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Set-up is idempotent: stamps skip the install and the native build when nothing changed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONSTRAINTS := requirements/dev-constraints.txt
DEPS_STAMP := $(VENV)/.deps-stamp
BUILD_STAMP := $(VENV)/.build-stamp
TEST_STAMP := $(VENV)/.test-deps-stamp
NATIVE_SOURCES := $(wildcard native/*.cpp native/*.h) CMakeLists.txt pyproject.toml

.PHONY: setup demo test bench lint clean

setup: $(BUILD_STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Build tools first, so the editable build below runs without build isolation (no re-downloads).
$(DEPS_STAMP): $(BIN)/python $(CONSTRAINTS) pyproject.toml
	$(BIN)/pip install -q -c $(CONSTRAINTS) scikit-build-core nanobind
	$(BIN)/pip install -q -c $(CONSTRAINTS) --no-build-isolation -e ".[torch,tune,dev]"
	touch $@

$(BUILD_STAMP): $(DEPS_STAMP) $(NATIVE_SOURCES)
	$(BIN)/pip install -q --no-build-isolation --no-deps -e .
	touch $@

# The tests also cover the TensorFlow face: install the `tensorflow` extra's packages (read
# from pyproject.toml, so the list lives in one place) without rebuilding the package.
$(TEST_STAMP): $(BUILD_STAMP) $(CONSTRAINTS) pyproject.toml requirements/extras.py
	$(BIN)/python requirements/extras.py tensorflow > $(VENV)/tensorflow-extra.txt
	$(BIN)/pip install -q -c $(CONSTRAINTS) -r $(VENV)/tensorflow-extra.txt
	touch $@

demo: setup
	$(BIN)/raytrain-x run -np 2 python examples/torch_digits.py

test: lint $(TEST_STAMP)
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python benchmarks/pack_bench.py

# ruff, then the layer contracts of DESIGN.md (import-linter; see [tool.importlinter]).
lint: setup
	$(BIN)/ruff check raytrain_x tests benchmarks examples
	$(BIN)/lint-imports

clean:
	rm -rf build $(VENV)
