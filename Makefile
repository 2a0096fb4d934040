# `make demo` and `make test` set everything up on a fresh machine: a local virtual
# environment in .venv with torch (the pinned CPU build where there is no CUDA), triton,
# and tjit installed in editable mode.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install --quiet torch; \
	else \
		$(PY) -m pip install --quiet torch==2.13.0; \
	fi
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) demo.py

test: $(STAMP)
	$(PY) -m pytest -q -n 2 tests

bench: $(STAMP)
	$(PY) bench/pointwise.py
	$(PY) bench/reductions.py
	$(PY) bench/memplan.py
	$(PY) bench/autograd.py

clean:
	rm -rf $(VENV)
