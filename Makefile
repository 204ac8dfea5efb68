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

.PHONY: run test test-gpu bench bench-gpu bench-graph browser-deps clean plan mutation

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

# The GPU tier on a CUDA machine as it is: the python and torch already there (no venv, no installs), every
# test but the real-browser one; the app tests are left out with the reason when streamlit/plotly are missing.
# The checkout is imported as `stagewise` through a link: build/gpu-path/stagewise -> this folder.
# TEST_GPU_ARGS passes pytest options, e.g. TEST_GPU_ARGS="-m gpu" (the CUDA tests alone) or "-n 12" (pytest-xdist).
TEST_GPU_ARGS ?=
test-gpu:
	mkdir -p build/gpu-path && ln -sfn "$(CURDIR)" build/gpu-path/stagewise
	PYTHONPATH="$(CURDIR)/build/gpu-path$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON) -m pytest -q -rs -m "not browser" -p no:cacheprovider $(TEST_GPU_ARGS)

bench: $(VENV)/.installed
	$(BIN)/python -m benchmarks.run

# The GPU benchmark (benchmarks/gpu.py: every way of running N members, throughput and latency, the issue's targets)
# on a CUDA machine as it is, like test-gpu: no venv, the checkout imported as `stagewise` through the same link.
# BENCH_ARGS passes options, e.g. BENCH_ARGS="--out $$OUT --budget-s 340" or --only TEXT.
BENCH_ARGS ?=
bench-gpu:
	mkdir -p build/gpu-path && ln -sfn "$(CURDIR)" build/gpu-path/stagewise
	PYTHONPATH="$(CURDIR)/build/gpu-path$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON) -m benchmarks.gpu --device cuda $(BENCH_ARGS)

# How fast the Plan page's graph draws (100 / 1,000 / 5,000 nodes), server side and in headless Chromium.
bench-graph: $(VENV)/.installed-test browser-deps
	$(BIN)/python -m benchmarks.graph_view --browser

# Mutation testing of the checking core, not part of `make test`: mutmut ([tool.mutmut] in pyproject.toml)
# changes one thing at a time in executor/verify.py, planner/validate.py, planner/edits.py,
# executor/autotune.py and executor/stages.py, and runs only the selected fast tests that reach the
# changed function. It works in a copy under MUTATION_DIR laid out as src/stagewise/ (mutmut names a
# mutant by its path without src/, which must equal the module the tests import: stagewise.planner...;
# its mutants/ folder stays out of the checkout; a later run re-tests only what changed). MUTANTS picks
# mutants by name glob, e.g. MUTANTS='stagewise.planner.validate.*'; the default is the checks themselves
# (compare, validate, include, autotune's _fastest, the loop runner, runner_for: 323 mutants, about an
# hour on one niced worker of 2 cores); MUTANTS= (empty) takes all ~2,200 of the five files (hours).
# `cd $(MUTATION_DIR) && mutmut show NAME` shows one mutant's diff.
MUTATION_DIR  ?= $(or $(TMPDIR),/tmp)/stagewise-mutation
MUTATION_JOBS ?= 1
MUTANTS       ?= 'stagewise.executor.verify.x_compare*' 'stagewise.planner.validate.x_validate*' \
                 'stagewise.planner.edits.x_include*' 'stagewise.executor.autotune.x__fastest*' \
                 'stagewise.executor.stages.xǁLoopRunnerǁrun*' 'stagewise.executor.stages.x_runner_for*'
MUTMUT        := $(abspath $(BIN))/mutmut

$(VENV)/.installed-mutation: $(VENV)/.installed-test
	$(PIP) install -q -c constraints.txt -e '.[test,mutation]'
	touch $@

mutation: $(VENV)/.installed-mutation
	rm -rf $(MUTATION_DIR)/src $(MUTATION_DIR)/sample_models $(MUTATION_DIR)/tests $(MUTATION_DIR)/pyproject.toml
	mkdir -p $(MUTATION_DIR)/src/stagewise
	cp -r __init__.py planner executor app sample_models $(MUTATION_DIR)/src/stagewise/
	cp -r sample_models tests pyproject.toml $(MUTATION_DIR)/
	cd $(MUTATION_DIR) && STAGEWISE_HYPOTHESIS_SCALE=0.1 nice -n 10 $(MUTMUT) run --max-children $(MUTATION_JOBS) $(MUTANTS) \
		> run.log 2>&1 || (tr '\r' '\n' < run.log | tail -n 30; exit 1)
	@tr '\r' '\n' < $(MUTATION_DIR)/run.log | grep -E 'mutations/second|done in' | tail -n 2
	@cd $(MUTATION_DIR) && $(MUTMUT) results --all true | sed -E 's/^ *([a-z_.]+)\.x(_|ǁ).*: /\1 /' \
		| awk '$$2 != "not" {n[$$1]++; if ($$2 == "killed" || $$2 == "timeout") k[$$1]++} \
		       END {for (f in n) printf "%-20s killed %4d / %4d mutants\n", f, k[f], n[f]}' | sort
	@echo "survivors: cd $(MUTATION_DIR) && $(MUTMUT) results; one diff: $(MUTMUT) show NAME"

clean:
	rm -rf $(VENV) .pytest_cache tests/artifacts
