# Two commands from nothing but Python: `make run` and `make test`.
# torch is pinned to the tested release through constraints.txt. The pin does not choose the build:
# PyPI's Linux torch wheel brings the CUDA libraries (gigabytes). Where pip has no CPU wheel of its own
# (a local wheel folder or index), a CPU-only machine passes TORCH_INDEX=https://download.pytorch.org/whl/cpu.
PYTHON ?= python3
TORCH_INDEX ?=
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
MODEL  ?= sample_models/transformer_block.py

.PHONY: run test bench browser-deps clean plan

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) install -q -c constraints.txt $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) torch==2.13.0
	$(PIP) install -q -c constraints.txt -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -c constraints.txt -e '.[test]'
	touch $@

# Debian's chromium for the real-browser test and graphviz's `dot` for SVG export.
# Best effort: without chromium the browser test is skipped and says why;
# without dot the app offers DOT only.
browser-deps:
	@missing=""; [ -x /usr/bin/chromium ] || missing="$$missing chromium"; command -v dot >/dev/null || missing="$$missing graphviz"; \
	if [ -n "$$missing" ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
		|| echo "could not install$$missing: the browser test will be skipped / SVG export disabled"; \
	fi

run: $(VENV)/.installed
	$(BIN)/stagewise ui $(MODEL)

plan: $(VENV)/.installed
	$(BIN)/stagewise plan sample_models/mlp.py -n 8 -o plan.json && $(BIN)/stagewise run plan.json sample_models/mlp.py

test: $(VENV)/.installed-test browser-deps
	$(BIN)/python -m pytest -q

bench: $(VENV)/.installed
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) .pytest_cache tests/artifacts
