# The two commands a new user runs: `make serve` (set up, then serve the demo model) and `make test`.
PY := .venv/bin/python
ARGS ?= --model demo

.PHONY: setup serve test bench bench-controller
setup:
	bash scripts/setup.sh

serve: setup
	$(PY) serve.py $(ARGS)

# Tests calibrate the demo GPTQ checkpoint on 16 windows (about 1 min, once) before the servers they start need it.
test: export MODESWITCH_GPTQ_SAMPLES ?= 16
test: setup
	$(PY) -m modeswitch.models --prepare demo-gptq
	$(PY) -m pytest -q tests

bench: setup
	$(PY) benchmarks/modes.py --extra-modes

bench-controller: setup
	$(PY) benchmarks/run.py --sweep
