#!/usr/bin/env bash
# The GPU check of issue 16 (every mode on the owned static-cache loop), as one prepared run on the lent H200:
# benchmarks/gpu_check.py in-process on a random-weight Llama-3.1-8B-shaped model, results (JSON + markdown)
# in $OUT. Needs torch, transformers and nvidia-ml-py, which the GPU image has; nothing to carry, unless the
# image's transformers predates the StaticCache layer API the loop uses (5.19): then put a transformers wheel
# in .gpu/whl/ and it is installed first. Run it with a timeout that leaves a rerun: it stops starting new
# sections after --budget-s (default 420 s), so it ends inside 8 minutes.
#   DEVICE=cpu SHAPE=tiny benchmarks/gpu_check.sh   # the CPU dry run of the same script
#   benchmarks/gpu_check.sh --prepare                # here, before the run: the transformers wheel this checkout
#                                                    # runs, into .gpu/whl/ (12 MB; pass carry: [".gpu"])
set -euo pipefail
if [ "${1:-}" = --prepare ]; then
  version=$(.venv/bin/python -c "import transformers; print(transformers.__version__)")
  .venv/bin/python -m pip download -q --no-deps "transformers==$version" -d .gpu/whl
  ls -la .gpu/whl
  exit 0
fi
OUT=${OUT:-/tmp/gpu-out}
DEVICE=${DEVICE:-cuda}
SHAPE=${SHAPE:-llama-3.1-8b}
ACCEPTANCE=${ACCEPTANCE:-benchmarks/results/gpu_check_cpu-dryrun.json}
mkdir -p "$OUT"
if compgen -G ".gpu/whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# compiled kernels outlive the run only where $OUT is kept; a rerun on a warm machine reuses /tmp's
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/modeswitch-inductor}
PYTHON=${PYTHON:-python3}
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
fi
"$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
args=(--device "$DEVICE" --shape "$SHAPE" --out "$OUT" --budget-s "${BUDGET_S:-420}")
if [ "$DEVICE" = cuda ] && [ -f "$ACCEPTANCE" ]; then
  args+=(--acceptance "$ACCEPTANCE")
fi
"$PYTHON" benchmarks/gpu_check.py "${args[@]}" "$@"
