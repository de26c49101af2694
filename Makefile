# Two commands for a fresh machine:
#   make train   creates .venv, installs paxcli, trains the built-in default experiment
#   make test    creates .venv, installs paxcli with test extras, runs the default test suite
#   (make test-slow runs the tests marked slow; CI, .ci/run, runs both)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.paxcli-installed

.PHONY: install train test test-slow bench bench-gpu clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The big install (JAX, TensorFlow, torch CPU for the tests: minutes) shows pip's progress.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --progress-bar on -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(BIN)/pax train $(ARGS)

# pytest's exit status 5 says no test was collected (ARGS='-k ...' matching none of a suite): no failure.
NONE_COLLECTED_OK = || [ $$? -eq 5 ]

# Two workers, one test file each at a time (module fixtures built once): most of a test is
# compiling, which leaves a core idle; tests/conftest.py shares one XLA compilation cache.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile $(ARGS) $(NONE_COLLECTED_OK)

# The tests marked slow, two workers the same way; then, one at a time, those also marked
# `alone` (several jax.distributed processes that miss heartbeats when another worker starves them).
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m 'slow and not alone' $(ARGS) $(NONE_COLLECTED_OK)
	$(BIN)/python -m pytest -q -m 'slow and alone' $(ARGS) $(NONE_COLLECTED_OK)

bench: $(STAMP)
	$(BIN)/python benchmarks/train_step.py
	$(BIN)/python benchmarks/infeed.py

# The GPU table (bench.Llama1B at batch 8 and 16, LmCloudSpmd2B on one device, launch to first
# step, async-save stall) on whatever GPU jax finds; needs CUDA JAX: .venv/bin/pip install -U "jax[cuda12]".
bench-gpu: $(STAMP)
	$(BIN)/python benchmarks/gpu.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
