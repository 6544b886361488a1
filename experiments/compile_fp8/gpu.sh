#!/bin/bash
# Issue 48's GPU check (<= 6 minutes on one H100 / H200): eager, compiled blocks, and compiled
# blocks + FP8 (tensorwise, rowwise) on GPT-2 124M and a 1B Llama (16 blocks, h 2048, GQA
# 32 / 8, SwiGLU 8192, Llama 3's 128,256-token vocabulary), bf16-mixed, micro-batch 4 x 4,
# sequence 1024, synthetic tokens, one pass each (the budget; compare against the published
# gains, not to name a winner): tokens/s, MFU (bf16 peak), compile s, activation and memory
# peaks from summary.json; then the FP8 and bf16 GEMM tables for the hardware profile
# (framework/sim/bench.py's fp8 points: torch._scaled_mm, e4m3, bf16 out), quick grid.
# Usage (repository root): bash experiments/compile_fp8/gpu.sh OUTDIR [cuda|cpu]
#   cpu: a smoke run (gpt2-tiny-sized, 4 steps, sequence 64, emulated FP8, aot_eager) that shows the script works.
# Stops starting runs after BUDGET_S seconds (default 300) so the device time stays under 6 minutes.
set -u
O=$(realpath -m "${1:?outdir}"); DEV=${2:-cuda}; mkdir -p "$O"; T0=$(date +%s); BUDGET_S=${BUDGET_S:-300}
if [ "$DEV" = cuda ]; then
  python3 -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | tail -2  # hydra, omegaconf, torchao
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$O/gpu.txt"
  PY=python3; STEPS=10; SEQ=1024; MB=4; SIZES=${SIZES:-"gpt2 llama-1b"}; BACKEND=inductor
else
  PY=$(pwd)/.venv/bin/python; STEPS=4; SEQ=64; MB=2; SIZES="gpt2-tiny"; BACKEND=aot_eager
fi
C="data=synthetic data.seq_len=$SEQ logger=none parallelism=single trainer.precision=bf16-mixed schedule.microbatches=4 trainer.micro_batch_size=$MB trainer.steps=$STEPS metrics.skip_first=3 trainer.log_interval=$STEPS trainer.global_batch_size=null"
model_args() {
  case $1 in
    llama-1b) echo "model=llama-tiny model.n_layer=16 model.n_embd=2048 model.n_head=32 model.n_kv_head=8 model.n_inner=8192 model.max_positions=$SEQ data.vocab_size=128256" ;;
    gpt2-tiny) echo "model=gpt2-tiny data.vocab_size=256" ;;
    *) echo "model=$1 data.vocab_size=50304" ;;
  esac
}
variants() {  # name|overrides
  echo "eager|"
  echo "compiled|trainer.compile=blocks trainer.compile_backend=$BACKEND"
  echo "compiled+fp8-tensorwise|trainer.compile=blocks trainer.compile_backend=$BACKEND precision.fp8=tensorwise"
  [ "$1" = gpt2 ] || echo "compiled+fp8-rowwise|trainer.compile=blocks trainer.compile_backend=$BACKEND precision.fp8=rowwise"
}
for m in $SIZES; do
  while IFS='|' read -r name extra; do
    if [ $(( $(date +%s) - T0 )) -gt "$BUDGET_S" ]; then echo "budget spent: $m $name not run"; continue; fi
    d=/tmp/cf8_${m}_$name
    timeout 120 $PY run.py $C $(model_args $m) $extra hydra.run.dir=$d > "$O/${m}_$name.log" 2>&1
    echo "$m $name rc=$? $(( $(date +%s) - T0 )) s"
    $PY - "$d" "$m" "$name" >> "$O/results.jsonl" <<'PY'
import json, sys
d, m, name = sys.argv[1:]
try:
    s = json.load(open(f"{d}/summary.json"))
except (OSError, ValueError) as e:
    s = {"error": str(e)}
print(json.dumps({"model": m, "variant": name, **{k: s.get(k) for k in (
    "tokens_per_s", "step_time_s", "mfu", "compile_s", "compiles_measured", "activation_peak_bytes_max",
    "memory_peak_bytes", "measured_steps", "error")}}))
PY
  done <<< "$(variants $m)"
done
# the GEMM tables the profile lacks: fp8 (and bf16 beside it, the same run), quick grid
PYTHONPATH=. timeout 90 $PY - "$DEV" > "$O/gemm_tables.yaml" 2> "$O/gemm_tables.err" <<'PY'
import sys
import torch
from framework.sim import bench
dev = torch.device(sys.argv[1])
if dev.type == "cuda":
    bench.DTYPES["cuda"] = ("fp8", "bf16")
print("gemm_tflops:")
for name, rows in bench.gemm(bench.Timer(dev, quick=True), dev.type, quick=True).items():
    print(f"  {name}: |\n" + "".join(f"    {r}\n" for r in rows.splitlines()))
PY
echo "gemm tables rc=$? $(( $(date +%s) - T0 )) s"
