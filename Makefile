# Two commands do all the set-up: `make demo` (the reproduction-and-fix demo) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.z3guard-ready
# Every other CPU-tested DeepSpeed release, one after another in one environment (tests/releases.py).
RELEASES := .venv-releases
RELEASES_STAMP := $(RELEASES)/.z3guard-ready
# z3guard as users get it: the sdist and wheel `python -m build` makes, the wheel installed (not editable).
WHEEL := .venv-wheel
PIP := -m pip install -q --disable-pip-version-check
export DS_ACCELERATOR := cpu
export DS_BUILD_OPS := 0
export OMP_NUM_THREADS ?= 1

.PHONY: demo test test-main test-wheel test-releases test-releases-full soak venv clean

venv: $(STAMP)

# torch first (the CPU file on this machine's disk), then DeepSpeed built without ops against it.
$(STAMP): pyproject.toml requirements-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) $(PIP) torch==2.13.0 setuptools wheel
	$(PY) $(PIP) --no-build-isolation -r requirements-cpu.txt
	$(PY) $(PIP) --no-deps --no-build-isolation -e .
	touch $@

$(RELEASES_STAMP): pyproject.toml requirements-releases.txt
	test -x $(RELEASES)/bin/python || $(PYTHON) -m venv $(RELEASES)
	$(RELEASES)/bin/python $(PIP) torch==2.13.0 setuptools wheel
	$(RELEASES)/bin/python $(PIP) --no-build-isolation -r requirements-releases.txt
	$(RELEASES)/bin/python $(PIP) --no-deps --no-build-isolation -e .
	touch $@

demo: $(STAMP)
	$(VENV)/bin/z3guard repro

test: demo test-main test-wheel test-releases  # the demo first: the README's first command

test-main: $(STAMP)
	$(PY) -m pytest -q --durations=25 tests

test-wheel: $(STAMP)
	rm -rf dist $(WHEEL)
	$(PY) -m build --no-isolation --outdir dist . > /dev/null
	$(PYTHON) -m venv $(WHEEL)
	$(WHEEL)/bin/python $(PIP) torch==2.13.0 setuptools wheel
	$(WHEEL)/bin/python $(PIP) --no-build-isolation -r requirements-cpu.txt -r requirements-trainers.txt
	$(WHEEL)/bin/python $(PIP) --no-deps dist/z3guard-*.whl
	Z3GUARD_WHEEL_PYTHON=$(abspath $(WHEEL))/bin/python $(PY) -m pytest -q tests/test_wheel.py

# Five releases (tests/releases.py CI): the self-check; two of them (SCENARIO) the report's scenario too. -full:
# every release every scenario, the save/load contract and the gathers (when adding a release or changing
# the adapter).
test-releases: $(RELEASES_STAMP)
	$(RELEASES)/bin/python tests/releases.py

test-releases-full: $(RELEASES_STAMP)
	$(RELEASES)/bin/python tests/releases.py --full

# A nightly-size run (not in CI): 1,000 guarded steps with every hazard at once, a resume every 100 (tests/soak.py).
soak: $(STAMP)
	$(PY) tests/soak.py --out soak-out

clean:
	rm -rf $(VENV) $(RELEASES) $(WHEEL) dist runs
