#!/bin/bash
# On a lent GPU (issue 46's "before" numbers): ours against the plain loop (plain_loop.py) on
# GPT-2 124M and 355M, bf16-mixed, micro-batch 8 x 4 accumulated, sequence 1024, synthetic
# tokens; then the host syncs per step of ours, from the sync-debug warnings of two run lengths.
# Usage (repository root): bash experiments/single_device/gpu.sh OUTDIR   [--device cpu: a smoke run]
set -u
O=${1:?outdir}; DEV=${2:-cuda}; mkdir -p "$O"
if [ "$DEV" = cuda ]; then
  python3 -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | tail -2
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$O/gpu.txt"
  PY=python3; STEPS=20; SEQ=1024; MB=8; SIZES="gpt2 gpt2-medium"
else
  PY=.venv/bin/python; STEPS=4; SEQ=64; MB=2; SIZES="gpt2-tiny"
fi
C="data=synthetic data.vocab_size=50304 data.seq_len=$SEQ logger=none parallelism=single trainer.precision=bf16-mixed schedule.microbatches=4 trainer.micro_batch_size=$MB trainer.log_interval=5"
for m in $SIZES; do
  for rep in 1 2; do  # alternating, twice
    timeout 150 $PY run.py $C model=$m trainer.steps=$STEPS hydra.run.dir=/tmp/ours_${m}_$rep > "$O/ours_${m}_$rep.log" 2>&1
    echo "ours $m rep $rep rc=$? $(tail -1 "$O/ours_${m}_$rep.log")"
    $PY - /tmp/ours_${m}_$rep "$m" "$rep" >> "$O/results.jsonl" <<'PY'
import json, sys
d, m, rep = sys.argv[1:]
s = json.load(open(f"{d}/summary.json"))
print(json.dumps({"impl": "ours", "model": m, "rep": int(rep), **{k: s.get(k) for k in
      ("tokens_per_s", "step_time_s", "mfu", "optimizer_s", "fwd_bwd_s", "measured_steps")}}))
PY
    timeout 150 $PY experiments/single_device/plain_loop.py --model $m --mb $MB --accum 4 --seq $SEQ --steps $STEPS --device $DEV > "$O/plain_${m}_$rep.json" 2> "$O/plain_${m}_$rep.err"
    echo "plain $m rep $rep rc=$? $(cat "$O/plain_${m}_$rep.json")"; cat "$O/plain_${m}_$rep.json" >> "$O/results.jsonl"
  done
done
if [ "$DEV" = cuda ]; then
  for n in 6 11; do
    COUNT_SYNCS=1 PYTHONPATH=experiments/single_device/syncs timeout 150 $PY run.py $C model=gpt2 trainer.steps=$n hydra.run.dir=/tmp/sync_$n > /tmp/sync_$n.out 2>&1
    c=$(cat /tmp/sync_$n.out /tmp/sync_$n/*.log 2>/dev/null | grep -c "synchronizing CUDA operation")
    echo "{\"impl\": \"ours\", \"model\": \"gpt2\", \"steps\": $n, \"sync_warnings\": $c}" | tee -a "$O/results.jsonl"
  done
fi
