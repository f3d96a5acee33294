# Two commands do all the set-up: `make demo` (the reproduction-and-fix demo) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.z3guard-ready
export DS_ACCELERATOR := cpu
export DS_BUILD_OPS := 0
export OMP_NUM_THREADS ?= 1

.PHONY: demo test venv clean

venv: $(STAMP)

# torch first (the CPU file on this machine's disk), then DeepSpeed built without ops against it.
$(STAMP): pyproject.toml requirements-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0 setuptools wheel
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation -r requirements-cpu.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/z3guard repro

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) runs
