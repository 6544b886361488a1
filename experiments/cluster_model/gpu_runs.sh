#!/bin/bash
# On a lent GPU machine: the device micro-benchmarks, then real single-GPU jobs of two GPT-2
# sizes in bf16-mixed (the measurements the cluster cost model is later checked against).
# Usage (repository root): bash experiments/cluster_model/gpu_runs.sh OUTDIR
set -u
O=${1:?outdir}; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,power.limit --format=csv > "$O/nvidia_smi.csv"
timeout 300 python3 experiments/cluster_model/gpu_microbench.py "$O/microbench.json"
C="data=synthetic data.vocab_size=50304 data.seq_len=1024 logger=none parallelism=single trainer.precision=bf16-mixed trainer.steps=25 trainer.log_interval=5"
for spec in "gpt2 8 false" "gpt2-medium 8 false" "gpt2-medium 8 true"; do
  set -- $spec
  d=/tmp/job_$1_$2_$3
  timeout 150 python3 run.py $C model=$1 trainer.micro_batch_size=$2 trainer.activation_checkpointing=$3 hydra.run.dir=$d > "$O/run_$1_mb$2_ac$3.log" 2>&1
  echo "$1 mb$2 ac=$3 rc=$?"; tail -3 "$O/run_$1_mb$2_ac$3.log"
  cp $d/summary.json "$O/summary_$1_mb$2_ac$3.json" 2>/dev/null
  cp $d/metrics.jsonl "$O/metrics_$1_mb$2_ac$3.jsonl" 2>/dev/null
done
