# The two commands a new user runs: `make serve` (set up, then serve the demo model) and `make test`.
PY := .venv/bin/python
ARGS ?= --model demo

.PHONY: setup serve test bench
setup:
	bash scripts/setup.sh

serve: setup
	$(PY) serve.py $(ARGS)

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PY) benchmarks/modes_demo.py
