# The project's tasks, one command each: `make lint` (ruff and the package's layers),
# `make types`, `make docs` (the documentation site, strict), `make unit` (the unit tier),
# `make fast` (the fast tier, under 2 minutes), `make test` (everything, as .ci/run runs
# it), `make install` (what the tests need), `make bench NAME=admission ARGS="--offered 16"`
# (one benchmark under benchmarks/), `make serve` (the whole service on this machine).
# docs/development.md has the table.
PYTHON ?= python
NAME ?=
ARGS ?=

.PHONY: install lint types docs unit fast test bench serve

install:
	$(PYTHON) -m pip install -e '.[test]'
	$(PYTHON) -m pip install --no-deps openai-whisper==20250625 resemblyzer==0.1.4

lint:
	ruff check .
	lint-imports

types:
	mypy

docs:
	mkdocs build --strict

unit:
	$(PYTHON) -m pytest -m unit

fast: lint types
	$(PYTHON) -m pytest -m fast

test: lint types docs
	$(PYTHON) -m pytest

bench:
	@test -n "$(NAME)" || { echo "make bench NAME=<a file in benchmarks/, without .py>"; exit 2; }
	$(PYTHON) benchmarks/$(NAME).py $(ARGS)

serve:
	$(PYTHON) -m cosyvoice serve
