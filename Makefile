# The two commands a new user runs: `make serve` (set up, then serve the demo model) and `make test`.
PY := .venv/bin/python
ARGS ?= --model demo

.PHONY: setup serve test test-fast bench bench-controller
setup:
	bash scripts/setup.sh

serve: setup
	$(PY) serve.py $(ARGS)

# Tests calibrate the demo GPTQ checkpoint on 16 windows (about 1 min, once) before the servers they start need it.
test: export MODESWITCH_GPTQ_SAMPLES ?= 16
test: setup
	$(PY) -m modeswitch.weights.presets --prepare demo-gptq
	$(PY) -m pytest -q tests

# The in-process layer alone (no model weights, no engines): about 40 s.
test-fast: setup
	$(PY) -m pytest -q tests/unit

bench: setup
	$(PY) benchmarks/modes.py --extra-modes

bench-controller: setup
	$(PY) benchmarks/run.py --sweep
