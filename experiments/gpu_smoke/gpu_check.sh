#!/bin/bash
# One-shot CUDA check of the framework on a single GPU (issue 29 session): bf16-mixed, fp16-mixed
# with an injected overflow, a MoE with grouped GEMM and capacity, and the pre-launch check of a
# 2-rank layout on one GPU.
set -u
python3 -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | tail -2  # the wheels the GPU image lacks (README)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
C="model=gpt2-tiny data=synthetic logger=none parallelism=single trainer.log_interval=10"
summ() { python3 - "$1" <<'PY'
import json, sys
d = sys.argv[1]
s = json.load(open(f"{d}/summary.json"))
keys = ["status", "reason", "loss", "tokens_per_s", "step_time_s", "mfu", "tflops", "peak_source", "peak_tflops_per_rank",
        "skipped_steps", "moe_dropped_fraction", "moe_route_margin", "memory_peak_bytes"]
print({k: s.get(k) for k in keys if k in s})
rows = [json.loads(l) for l in open(f"{d}/metrics.jsonl")]
print("steps", len(rows), "overflow at", [r["step"] for r in rows if r.get("overflow")], "loss_scale", [r.get("loss_scale") for r in rows][:8])
PY
}
echo "== 1 bf16-mixed gpt2-tiny"; timeout 200 python3 run.py $C trainer.steps=30 trainer.precision=bf16-mixed hydra.run.dir=/tmp/r1 2>&1 | tail -4; summ /tmp/r1
echo "== 2 fp16-mixed, inf on rank 0 at step 5"; timeout 200 python3 run.py $C trainer.steps=10 trainer.precision=fp16-mixed debug.inf_grad_step=5 debug.inf_grad_rank=0 hydra.run.dir=/tmp/r2 2>&1 | tail -3; summ /tmp/r2
echo "== 3 moe-tiny bf16-mixed grouped GEMM, capacity 1.0"; timeout 200 python3 run.py model=moe-tiny data=synthetic logger=none parallelism=single trainer.steps=20 trainer.precision=bf16-mixed model.moe.experts_impl=grouped ++model.moe.capacity_factor=1.0 hydra.run.dir=/tmp/r3 2>&1 | tail -3; summ /tmp/r3
echo "== 4 moe-tiny auto experts_impl, fp32"; timeout 200 python3 run.py model=moe-tiny data=synthetic logger=none parallelism=single trainer.steps=10 hydra.run.dir=/tmp/r4 2>&1 | tail -2; summ /tmp/r4
echo "== 5 the default pp2 job on one GPU (expect a pre-launch error)"; timeout 120 python3 run.py data=synthetic logger=none trainer.steps=3 hydra.run.dir=/tmp/r5 2>&1 | tail -4; echo "rc=$?"
echo "== 6 unknown key"; timeout 60 python3 run.py trainer.stepz=3 2>&1 | tail -2
