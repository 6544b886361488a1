#!/bin/bash
# On a lent GPU machine: the framework's own device calibration (python -m framework.sim.bench)
# written as a hardware profile, then real single-GPU bf16 jobs of shapes the 2026-11-26 runs
# (gpu_runs.sh) did not cover, for the cost model's predicted-vs-measured table.
# Usage (repository root): bash experiments/cluster_model/gpu_calibrate.sh OUTDIR
set -u
O=${1:?outdir}; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv > "$O/nvidia_smi.csv"
t0=$(date +%s)
timeout 300 python3 -m framework.sim.bench --out "$O/h200-measured.yaml" --name h200-measured \
  --peak-tflops bf16=989.5,fp16=989.5,fp32=66.9 > "$O/bench.log" 2>&1
echo "bench rc=$? $(( $(date +%s) - t0 )) s"; tail -2 "$O/bench.log"
C="data=synthetic data.vocab_size=50304 logger=none parallelism=single trainer.precision=bf16-mixed trainer.steps=15 trainer.log_interval=5"
L="model=llama-tiny model.name=llama-1b model.n_layer=16 model.n_embd=2048 model.n_head=16 model.n_kv_head=8 model.n_inner=5632 model.max_positions=2048"
run() {  # name, overrides...
  local n=$1; shift; local d=/tmp/job_$n
  timeout 120 python3 run.py $C "$@" hydra.run.dir=$d > "$O/run_$n.log" 2>&1
  echo "$n rc=$? $(( $(date +%s) - t0 )) s"; tail -2 "$O/run_$n.log"
  cp $d/summary.json "$O/summary_$n.json" 2>/dev/null; cp $d/metrics.jsonl "$O/metrics_$n.jsonl" 2>/dev/null
}
run gpt2_mb16 model=gpt2 data.seq_len=1024 trainer.micro_batch_size=16
run gpt2_s512_mb8 model=gpt2 data.seq_len=512 trainer.micro_batch_size=8
run llama1b_s2048_mb2 $L data.seq_len=2048 trainer.micro_batch_size=2
run llama1b_s2048_mb2_ac $L data.seq_len=2048 trainer.micro_batch_size=2 trainer.activation_checkpointing=true
