#!/bin/bash
# The cost model's speed on this machine (issue 31's acceptance: a 405B-class layout on 16,384
# GPUs priced in under 10 s; a search.mode=simulate sweep of at least 50 layouts ranked in under
# a minute). Wall time of each command, as a user runs it (imports and Hydra included).
# Usage (repository root): bash experiments/cluster_model/speed.sh
set -u
PY=${PY:-.venv/bin/python}
t0=$(date +%s.%N)
$PY -m framework.simulate hardware=h100-sxm hardware.gpus=16384 model=llama3-405b data.seq_len=8192 \
  trainer.micro_batch_size=1 trainer.precision=bf16-mixed parallelism.dp=128 parallelism.tp=8 parallelism.pp=16 \
  parallelism.sequence_parallel=true parallelism.zero=1 schedule=interleaved schedule.virtual_stages=2 \
  schedule.microbatches=16 logger=none | cut -c1-160
t1=$(date +%s.%N)
echo "405B on 16,384 GPUs: $(echo "$t1 - $t0" | bc) s"
rm -rf /tmp/speed_sweep
$PY run.py -m model=llama3-70b hardware=h100-sxm hardware.gpus=4096 search.mode=simulate data=synthetic \
  data.seq_len=8192 trainer.micro_batch_size=1 trainer.precision=bf16-mixed logger=none trainer.global_batch_size=1024 \
  parallelism.tp=2,4,8 parallelism.pp=2,4,8 parallelism.dp=8,16,32 parallelism.zero=0,1 parallelism.sequence_parallel=true \
  schedule=interleaved hydra.sweep.dir=/tmp/speed_sweep 2>&1 | tail -1
t2=$(date +%s.%N)
echo "$(ls -d /tmp/speed_sweep/*/ | wc -l) layouts ranked: $(echo "$t2 - $t1" | bc) s"
