# Two commands do all the set-up: `make demo` (the reproduction-and-fix demo) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.z3guard-ready
# DeepSpeed 0.14.4, the oldest release that runs beside torch 2.13 on CPU, in an environment of its own.
COMPAT := .venv-ds0.14
COMPAT_STAMP := $(COMPAT)/.z3guard-ready
PIP := -m pip install -q --disable-pip-version-check
export DS_ACCELERATOR := cpu
export DS_BUILD_OPS := 0
export OMP_NUM_THREADS ?= 1

.PHONY: demo test test-main test-compat venv clean

venv: $(STAMP)

# torch first (the CPU file on this machine's disk), then DeepSpeed built without ops against it.
$(STAMP): pyproject.toml requirements-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) $(PIP) torch==2.13.0 setuptools wheel
	$(PY) $(PIP) --no-build-isolation -r requirements-cpu.txt
	$(PY) $(PIP) --no-deps --no-build-isolation -e .
	touch $@

$(COMPAT_STAMP): pyproject.toml requirements-compat.txt
	test -x $(COMPAT)/bin/python || $(PYTHON) -m venv $(COMPAT)
	$(COMPAT)/bin/python $(PIP) torch==2.13.0 setuptools wheel
	$(COMPAT)/bin/python $(PIP) --no-build-isolation -r requirements-compat.txt
	$(COMPAT)/bin/python $(PIP) --no-deps --no-build-isolation -e .
	touch $@

demo: $(STAMP)
	$(VENV)/bin/z3guard repro

test: test-main test-compat

test-main: $(STAMP)
	$(PY) -m pytest -q tests

test-compat: $(COMPAT_STAMP)
	$(COMPAT)/bin/python -m pytest -q tests/test_matrix.py tests/test_gather.py tests/test_contract.py

clean:
	rm -rf $(VENV) $(COMPAT) runs
