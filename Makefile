# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Set-up is idempotent: stamps skip the install and the native build when nothing changed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONSTRAINTS := requirements/dev-constraints.txt
UV := $(BIN)/uv
DEMO_STAMP := $(VENV)/.demo-deps-stamp
BUILD_STAMP := $(VENV)/.build-stamp
TEST_STAMP := $(VENV)/.test-deps-stamp
NATIVE_SOURCES := $(wildcard native/*.cpp native/*.h) CMakeLists.txt pyproject.toml
# The editable install maps each module to its file: a module added, moved or turned into a
# package needs a fresh one. This file changes only when the list of modules does.
MODULE_LIST := $(VENV)/.module-list
# uv installs (one resolve, parallel downloads), looking where pip is configured to look. It
# compiles bytecode at install, as pip does: uv does not by default, and where
# PYTHONDONTWRITEBYTECODE is set nothing writes it later, so every import of torch, Ray and
# TensorFlow would compile from source again (the test run took 1.7x as long).
INSTALL = $(UV) pip install --python $(BIN)/python -c $(CONSTRAINTS) --compile-bytecode \
	$(shell $(PYTHON) requirements/pip_sources.py)

.PHONY: setup demo test check bench lint clean soak-sim docs wheel FORCE

setup: $(BUILD_STAMP)

$(UV):
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c $(CONSTRAINTS) uv

# What the demo imports (the project's dependencies, torch, scikit-learn for the digits) and the
# build tools, so the editable build below runs without build isolation. `-r pyproject.toml`
# installs the project's dependencies, not the project.
$(DEMO_STAMP): $(UV) $(CONSTRAINTS) pyproject.toml
	$(INSTALL) scikit-build-core nanobind -r pyproject.toml --extra torch --extra examples
	touch $@

$(MODULE_LIST): FORCE
	@mkdir -p $(VENV)
	@find raytrain_x -name '*.py' | sort > $@.new
	@cmp -s $@.new $@ && rm $@.new || mv $@.new $@

# uv would reuse a cached build of the project, so a changed native source asks for a fresh one.
$(BUILD_STAMP): $(DEMO_STAMP) $(NATIVE_SOURCES) $(MODULE_LIST)
	$(INSTALL) -q --no-build-isolation --no-deps --reinstall-package raytrain-x -e .
	touch $@

# The tests add the test tools and every extra they cover: TensorFlow, Tune, Ray Train and Data,
# `ray job submit`.
# TensorFlow's asynchronous kernel is built here too (it is built on first use otherwise).
$(TEST_STAMP): $(BUILD_STAMP) $(CONSTRAINTS) pyproject.toml
	$(INSTALL) -r pyproject.toml --extra dev --extra torch --extra examples --extra tensorflow \
		--extra tune --extra train --extra job --extra checkpoint
	$(BIN)/python -m raytrain_x.tensorflow.kernels
	touch $@

demo: setup
	$(BIN)/raytrain-x run -np 2 python examples/torch_digits.py

# Two suite processes (pytest-xdist), a test file each at a time, each with its own session
# cluster: on a 2-core machine the suite takes about 0.85x as long as in one process
# (docs/contributing.md, "The suite's time"). TEST_PROCESSES=0 runs it in one.
TEST_PROCESSES ?= 2
test: lint
	$(BIN)/python -m pytest $(if $(filter-out 0,$(TEST_PROCESSES)),-n $(TEST_PROCESSES) --dist loadfile)

# The tier a developer runs before each commit (about 2 minutes): lint, then the unit tests
# (the pure logic, the policies, the simulator's scenarios and its share of random
# schedules; real processes where a test needs them, no Ray cluster).
check: lint
	$(BIN)/python -m pytest tests/unit $(if $(filter-out 0,$(TEST_PROCESSES)),-n $(TEST_PROCESSES))

# The benchmarks behind the README's and docs/performance.md's figures, one at a time
# (about 90 minutes; `benchmarks/claims.py --list`, `--only NAME`).
bench: setup
	$(BIN)/python benchmarks/claims.py

# The elastic job in the deterministic simulator: 100,000 random fault schedules on every
# core, then the named scenarios (docs/elastic.md, "Simulation").
soak-sim: $(TEST_STAMP)
	$(BIN)/python -m raytrain_x.testing.simulate --schedules 100000 --seed 0 \
		--json results/soak_sim.json

# The docs site into site/ (MkDocs; warnings and broken links fail it). The API reference is
# generated from the docstrings (tools/mkdocs_hooks.py).
docs: $(TEST_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The wheel into dist/ (scikit-build-core builds the native core; the build tools come with
# the demo's set-up, so no isolated build environment is fetched).
wheel: $(DEMO_STAMP)
	$(UV) build --wheel --no-build-isolation --python $(BIN)/python --out-dir dist .

# ruff, then the layer contracts of docs/architecture.md (import-linter; see [tool.importlinter]).
lint: $(TEST_STAMP)
	$(BIN)/ruff check raytrain_x tests benchmarks examples tools
	$(BIN)/lint-imports

clean:
	rm -rf build dist site $(VENV)
