# `make run`, `make bench` and `make test` each create the virtual environment when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run run-avx2 bench archs test test-harness lab lint clean

# TORCH_INDEX: where the pinned torch comes from when set, e.g. PyTorch's CPU-only index
# (make test TORCH_INDEX=https://download.pytorch.org/whl/cpu); unset, pip's own indexes decide,
# and PyPI's Linux wheel of the pinned version is the CUDA build (it runs on a CPU too).
TORCH_INDEX ?=

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-deps -e .  # first: a Python it does not support is named here
	$(if $(TORCH_INDEX),$(PY) -m pip install -q "$$(grep '^torch==' requirements.txt)" \
		--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -r requirements.txt
	touch $(STAMP)

# Executes the notebooks with papermill, writes results/, the README table and the report.
run: $(STAMP)
	$(PY) -m recipes_lib run

# `run` with the CPU kernels capped to AVX2 (recipes_lib.device.cap_cpu_isa): the reference's code
# paths on a newer CPU, into results/cpu-avx2-capped/; the README puts its speed claims beside
# the uncapped run's.
run-avx2: $(STAMP)
	$(PY) -m recipes_lib run --cap-isa avx2
	$(PY) -m recipes_lib readme

# `run`, then asserts every speed claim on the reference machine (2-core x86_64 AVX2 CPU).
bench: $(STAMP)
	$(PY) -m recipes_lib bench

# Every notebook on a tiny model of each architecture (Qwen2, Qwen3, Mistral, Phi-3, Gemma-2,
# Llama): results/architectures.json and the README's table (also part of `bench`).
archs: $(STAMP)
	$(PY) -m recipes_lib archs

# Correctness and memory only: speed claims are reported, never asserted; results go to a
# temporary folder (conftest.py: removed at the end, whatever paths pytest is given), so the
# tests leave the tree as they found it. Notebooks 01-03 run under
# nbval; notebook 04 runs through papermill with MODEL_ID set to a local folder
# (tests/test_notebooks.py), the path the README documents. TEST_WORKERS parallel workers, one
# thread each on a 2-core machine (conftest.py; tests/conftest.py splits the work);
# TEST_WORKERS=0: one process. The tests marked `harness` (the launcher's failing, hung and
# restarted ranks, the GPU session's smoke run, a notebook run alone: the course's tooling under
# failure, mostly process start-ups and deliberate waits) are left to `make test-harness`, which
# CI runs after this one: `make test` is the 10-minute loop, every recipe's test and notebook in it.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q --durations=10 tests notebooks -m "not harness" \
		--nbval-lax --ignore=notebooks/executed \
		--ignore=notebooks/04_training_long_sequences.ipynb \
		-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-harness: $(STAMP)
	$(PY) -m pytest -q --durations=10 tests -m harness \
		-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/

lint: $(STAMP)
	$(VENV)/bin/ruff check recipes_lib tests bench notebooks conftest.py

clean:
	rm -rf notebooks/executed .cache
