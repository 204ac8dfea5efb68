# Two commands from nothing but Python: `make run` and `make test`.
# torch is pinned through constraints.txt so a CPU-only machine never pulls the CUDA build.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
MODEL  ?= sample_models/mlp.py

.PHONY: run test bench browser-deps clean plan

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -c constraints.txt -e '.[test]'
	touch $@

# Debian's chromium for the real-browser test. Best effort: when it cannot be
# installed the browser test is skipped and says why.
browser-deps:
	@if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
		|| echo "chromium could not be installed; the browser test will be skipped"; \
	fi

run: $(VENV)/.installed
	$(BIN)/stagewise ui $(MODEL)

plan: $(VENV)/.installed
	$(BIN)/stagewise plan $(MODEL) -n 8 -o plan.json && $(BIN)/stagewise run plan.json $(MODEL)

test: $(VENV)/.installed-test browser-deps
	$(BIN)/python -m pytest -q

bench: $(VENV)/.installed
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) .pytest_cache tests/artifacts
