#!/bin/bash
# Issue 46's GPU check (<= 6 minutes on one H100 / H200): ours after the change (this tree),
# ours before it (BEFORE: a folder holding the tree at 8b4735f, e.g.
# `git archive 8b4735f | tar -x -C before/`, carried to the device), and the plain loop's
# bf16-mixed twin (bf16 weights, fp32 masters, fused AdamW: the same arithmetic), on GPT-2
# 124M and 355M and a 1B Llama (16 blocks, h 2048, GQA 32 / 8, SwiGLU 8192, Llama 3's
# 128,256-token vocabulary), bf16-mixed, micro-batch 4 x 4, sequence 1024, synthetic tokens,
# two alternating passes; per run tokens/s, MFU, optimizer ms, the host syncs of the last step
# (ours after: metrics.jsonl's host_syncs, counted by framework/device.py; plain: torch's
# sync-debug warnings over one step), and the cost model's prediction for ours (hardware=$HW).
# Usage (repository root): bash experiments/single_device/gpu.sh OUTDIR [cuda|cpu] [BEFORE]
#   cpu: a smoke run (gpt2-tiny, 4 steps, sequence 64) that shows the script works.
set -u
O=$(realpath -m "${1:?outdir}"); DEV=${2:-cuda}; BEFORE=${3:-}; mkdir -p "$O"
if [ "$DEV" = cuda ]; then
  python3 -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | tail -2
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$O/gpu.txt"
  PY=python3; STEPS=12; SEQ=1024; MB=4; SIZES=${SIZES:-"gpt2 gpt2-medium llama-1b"}; HW=h200; PASSES=${PASSES:-"1 2"}
else
  PY=$(pwd)/.venv/bin/python; STEPS=4; SEQ=64; MB=2; SIZES="gpt2-tiny"; PASSES="1"
  HW="cpu-local +hardware.peak_tflops.bf16=0.1"  # the profile has no bf16 peak (only the plan reads it)
fi
C="data=synthetic data.seq_len=$SEQ logger=none parallelism=single trainer.precision=bf16-mixed schedule.microbatches=4 trainer.micro_batch_size=$MB trainer.steps=$STEPS metrics.skip_first=3 trainer.log_interval=$STEPS trainer.global_batch_size=null"
model_args() {  # ours' overrides and the plain loop's arguments of a size
  case $1 in
    llama-1b) echo "model=llama-tiny model.n_layer=16 model.n_embd=2048 model.n_head=32 model.n_kv_head=8 model.n_inner=8192 model.max_positions=$SEQ data.vocab_size=128256|--arch llama --layers 16 --width 2048 --heads 32 --kv-heads 8 --inner 8192 --vocab 128256" ;;
    gpt2-tiny) echo "model=gpt2-tiny data.vocab_size=256|--model gpt2-tiny --vocab 256" ;;
    *) echo "model=$1 data.vocab_size=50304|--model $1" ;;
  esac
}
for m in $SIZES; do
  IFS='|' read -r OURS PLAIN <<< "$(model_args $m)"
  for rep in $PASSES; do
    for tree in after before; do
      if [ $tree = before ]; then [ -n "$BEFORE" ] || continue; DIR=$BEFORE; else DIR=.; fi
      (cd "$DIR" && timeout 200 $PY run.py $C $OURS hydra.run.dir=/tmp/ours_${tree}_${m}_$rep > "$O/ours_${tree}_${m}_$rep.log" 2>&1)
      echo "ours $tree $m rep $rep rc=$?"
      $PY - /tmp/ours_${tree}_${m}_$rep "$m" "$rep" "$tree" >> "$O/results.jsonl" <<'PY'
import json, sys
d, m, rep, tree = sys.argv[1:]
try:
    s = json.load(open(f"{d}/summary.json"))
    last = [json.loads(l) for l in open(f"{d}/metrics.jsonl")][-1]
except (OSError, ValueError) as e:
    s, last = {"error": str(e)}, {}
print(json.dumps({"impl": f"ours-{tree}", "model": m, "rep": int(rep), "host_syncs": last.get("rank_host_syncs"),
                  **{k: s.get(k) for k in ("tokens_per_s", "step_time_s", "mfu", "optimizer_s", "fwd_bwd_s",
                                           "measured_steps", "error")}}))
PY
    done
    timeout 200 $PY experiments/single_device/plain_loop.py $PLAIN --mb $MB --accum 4 --seq $SEQ --steps $STEPS --device $DEV --precision bf16-mixed > "$O/plain_${m}_$rep.json" 2> "$O/plain_${m}_$rep.err"
    echo "plain $m rep $rep rc=$? $(cat "$O/plain_${m}_$rep.json")"; cat "$O/plain_${m}_$rep.json" >> "$O/results.jsonl"
  done
  PYTHONPATH=. $PY - "$m" $C $OURS hardware=$HW >> "$O/results.jsonl" <<'PY'
import json, sys
from framework.sim.cost.plan import plan
m, *over = sys.argv[1:]
hw = next(o.split("=", 1)[1] for o in over if o.startswith("hardware="))
p = plan(over)
print(json.dumps({"impl": "cost-model", "model": m, "hardware": hw, "step_time_s": p["step_s"]}))
PY
done
cat "$O/results.jsonl"
