# `make run` and `make test` each create the virtual environment when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lab lint clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q -e .
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m recipes_lib run

test: $(STAMP)
	$(PY) -m pytest -q --durations=10 tests notebooks --nbval-lax --ignore=notebooks/executed

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/

lint: $(STAMP)
	$(VENV)/bin/ruff check recipes_lib tests

clean:
	rm -rf notebooks/executed .cache
