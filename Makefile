# Everything a fresh machine needs: `make demo` and `make test` create .venv and install.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# CPU install path: torch pinned to the CPU build that installs from local disk.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) jobs/grpo.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q tests $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/engine_throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache
