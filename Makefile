# Two commands a newcomer needs: `make run` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test check lint fmt types unit venv clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[engine,sim,dev]'
	touch $(STAMP)

venv: $(STAMP)

## run: two reference engines and the router (observe mode) on 127.0.0.1:8000
run: $(STAMP)
	$(BIN)/ramjet stack --policy policies/observe.yaml --port 8000

## test: format check, lint, strict types on ramjet/, then the tests
test: $(STAMP) check unit

check: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest -q

fmt: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
