#!/bin/bash
# The first multi-GPU run (<= 5 minutes on a machine lent with several GPUs; the developers'
# guide: run it before anything else there). Each distributed layout against the single
# process in fp32 over NCCL, with its breakdown and its sync counts (check.py says what).
# Usage (repository root): bash experiments/gpu_multi/check.sh OUTDIR [cuda|cpu] [--only A,B]
set -u
O=$(realpath -m "${1:?outdir}"); DEV=${2:-cuda}; shift $(( $# < 2 ? $# : 2 )); mkdir -p "$O"
if [ "$DEV" = cuda ]; then
  python3 -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | tail -2  # the wheels the GPU image lacks
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$O/gpus.txt"
  PY=python3
else
  PY=${PYTHON:-$(pwd)/.venv/bin/python}
fi
$PY experiments/gpu_multi/check.py --out "$O" --device "$DEV" "$@" 2>&1 | tee "$O/check.jsonl"
exit "${PIPESTATUS[0]}"
