# The project's tasks, one command each: `make lint`, `make types`, `make fast` (the fast
# tier, under 2 minutes), `make test` (the whole suite, as .ci/run runs it), `make install`
# (what the tests need), `make bench NAME=admission ARGS="--offered 16"` (one benchmark under
# benchmarks/), `make serve` (the whole service on this machine).
PYTHON ?= python
NAME ?=
ARGS ?=

.PHONY: install lint types fast test bench serve

install:
	$(PYTHON) -m pip install -e '.[test]'
	$(PYTHON) -m pip install --no-deps openai-whisper==20250625

lint:
	ruff check .

types:
	mypy

fast: lint types
	$(PYTHON) -m pytest -m fast

test: lint types
	$(PYTHON) -m pytest

bench:
	@test -n "$(NAME)" || { echo "make bench NAME=<a file in benchmarks/, without .py>"; exit 2; }
	$(PYTHON) benchmarks/$(NAME).py $(ARGS)

serve:
	$(PYTHON) -m cosyvoice serve
