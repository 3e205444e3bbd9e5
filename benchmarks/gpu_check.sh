#!/usr/bin/env bash
# The GPU check of the quantized-modes issue, as run on the lent H200 (one prepared run, results in $OUT).
# Needs, carried beside the tree in .gpu/: whl/ (flask, waitress, pydantic, bitsandbytes, transformers 5.19 ...
# that the GPU image lacks) and tokenizer/ (the demo tokenizer files). See benchmarks/README.md.
set -euo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
python3 -c "import torch, transformers, bitsandbytes; print('torch', torch.__version__, 'transformers', transformers.__version__, 'bnb', bitsandbytes.__version__)"
python3 benchmarks/make_random_llama.py --shape llama-3.1-8b --out /tmp/llama8b --tokenizer .gpu/tokenizer --device cuda
python3 benchmarks/modes.py --model /tmp/llama8b --tag h200 --repeats 2 --max-tokens 32 --concurrency 8 \
  --no-perplexity --no-decision-loop --out "$OUT" --log-dir "$OUT" -- --max-model-len 2048 \
  --modes fp16,int8,prefix_cache,continuous_batching,speculative,int8+continuous_batching
