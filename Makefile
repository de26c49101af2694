# Two commands for a fresh machine:
#   make train   creates .venv, installs paxcli (what the default run needs), trains the default experiment
#   make test    creates .venv, installs paxcli with its test extras, runs the default test suite
#   (make test-slow runs the tests marked slow; CI, .ci/run, runs both; make docs builds the site)
# Installs take the versions in constraints.txt, the lock the suite passed with:
#   make lock      rewrites the lock from .venv, keeping its versions and adding new dependencies
#   make upgrade   the newest releases pyproject.toml allows, in .venv-upgrade; the lock only if the suite passes
#   make install CONSTRAINTS=    installs without the lock
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# One stamp per install: the runtime (paxcli and what it needs to train: `make train`), and on top of it
# the test tools and every extra the tests run (TensorFlow and seqio, torch, transformers, lm-eval, W&B,
# MLflow, mkdocs: `make test`, `make install`), and the docs site's tools (`make docs`).
RUNTIME := $(VENV)/.paxcli-runtime
TESTS   := $(VENV)/.paxcli-tests
DOCS    := $(VENV)/.paxcli-docs
CONSTRAINTS ?= constraints.txt
PIN    := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
UPGRADE := .venv-upgrade

.PHONY: install train test test-slow docs lock upgrade bench bench-gpu clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Both installs show pip's progress (JAX alone is a minute; TensorFlow and torch CPU for the tests, more).
$(RUNTIME): pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(BIN)/python -m pip install --progress-bar on $(PIN) -e .
	touch $(RUNTIME)

$(TESTS): $(RUNTIME)
	$(BIN)/python -m pip install --progress-bar on $(PIN) -e '.[test]'
	touch $(TESTS)

$(DOCS): $(RUNTIME)
	$(BIN)/python -m pip install --progress-bar on $(PIN) -e '.[docs]'
	touch $(DOCS)

install: $(TESTS)

train: $(RUNTIME)
	$(BIN)/pax train $(ARGS)

# pytest's exit status 5 says no test was collected (ARGS='-k ...' matching none of a suite): no failure.
NONE_COLLECTED_OK = || [ $$? -eq 5 ]

# Two workers, one test file each at a time (module fixtures built once): most of a test is
# compiling, which leaves a core idle; tests/conftest.py shares one XLA compilation cache.
test: $(TESTS)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile $(ARGS) $(NONE_COLLECTED_OK)

# The tests marked slow, two workers the same way; then, one at a time, those also marked
# `alone` (several jax.distributed processes that miss heartbeats when another worker starves them),
# each named as it starts and timed as it ends (-v): a log cut short still says where the time went.
# Both share one XLA compilation cache (the tiny models they train are the same), made here unless the
# caller gives one (.ci/run gives one to both suites), removed after.
test-slow: $(TESTS)
	@own=; if [ -z "$$JAX_COMPILATION_CACHE_DIR" ]; then own=$$(mktemp -d); export JAX_COMPILATION_CACHE_DIR=$$own; fi; \
	  $(BIN)/python -m pytest -q -n 2 --dist loadfile -m 'slow and not alone' $(ARGS) $(NONE_COLLECTED_OK) \
	  && $(BIN)/python -m pytest -v -m 'slow and alone' $(ARGS) $(NONE_COLLECTED_OK); \
	  status=$$?; [ -z "$$own" ] || rm -rf "$$own"; exit $$status

# The docs site into site/ (mkdocs.yml; the knob and command pages are written from the code).
docs: $(DOCS)
	$(BIN)/python -m mkdocs build --strict

# The lock from .venv: what it has installed for paxcli[test,docs]. After a dependency is added to
# pyproject.toml this installs it (the locked versions stay) and writes it into the lock.
lock: $(TESTS)
	$(BIN)/python -m pip install --quiet $(PIN) -e '.[test,docs]'
	$(BIN)/python tools/lock.py --write

# The newest releases pyproject.toml allows, in a venv of their own; the default suite on them,
# and the lock rewritten from that venv only if it passes (then `make` reinstalls .venv from it).
upgrade:
	rm -rf $(UPGRADE)
	$(PYTHON) -m venv $(UPGRADE)
	$(UPGRADE)/bin/python -m pip install --quiet --upgrade pip
	$(UPGRADE)/bin/python -m pip install --quiet --upgrade -e '.[test,docs]'
	$(UPGRADE)/bin/python -m pytest -q -n 2 --dist loadfile
	$(UPGRADE)/bin/python tools/lock.py --write

bench: $(RUNTIME)
	$(BIN)/python benchmarks/train_step.py
	$(BIN)/python benchmarks/infeed.py

# The GPU table (bench.Llama1B at batch 8 and 16, LmCloudSpmd2B on one device, launch to first
# step, async-save stall) on whatever GPU jax finds; needs CUDA JAX: .venv/bin/pip install -U "jax[cuda12]".
bench-gpu: $(RUNTIME)
	$(BIN)/python benchmarks/gpu.py

clean:
	rm -rf $(VENV) $(UPGRADE) build site *.egg-info src/*.egg-info
