"""experiments/gpu_multi/check.sh, the first multi-GPU run, works on its first try: run here
with gloo on CPU for one layout (pp 2 with zbh1 against its single-process reference), the
way check.sh runs on a lent machine (the whole set: `--only` left out, ~5 minutes there)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments/gpu_multi"))

import check  # noqa: E402  experiments/gpu_multi/check.py


def test_the_tolerance_tells_a_wrong_gradient_from_round_off():
    assert check.close(5.547478437, 5.547478675)  # pp2_zbh1 against single on CPU, fp32: 4e-8
    assert not check.close(5.5475, 5.5475 * (1 + 1e-3))  # what a wrong gradient moves
    assert check.close(5.57205, 5.57205 * (1 + 5e-4), "moe") and not check.close(5.57205, 5.57205 * (1 + 5e-4))


def test_the_multi_gpu_check_runs_with_gloo(tmp_path):
    r = subprocess.run(["bash", "experiments/gpu_multi/check.sh", str(tmp_path), "cpu", "--only", "pp2_zbh1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "check.jsonl").read_text().splitlines()]
    layout, last = lines[0], lines[-1]
    assert last == {"ok": True, "steps": check.STEPS, "device": "cpu"}
    assert layout["layout"] == "pp2_zbh1" and layout["ranks"] == 2 and layout["same_as_single"]
    assert 0 <= layout["worst_rel_diff"] < check.TOLERANCE["dense"]["rtol"]
    assert len(layout["loss"]) == check.STEPS and layout["loss"] != layout["reference_loss"][::-1]
    assert layout["breakdown_s"]["time_compute_s"] > 0 and 0 < layout["bubble_fraction"] < 1
    assert len(layout["host_syncs_last_step"]) == 2  # one count per rank
    assert layout["cuda_sync_warnings_whole_run"] is None  # CPU: torch's count is CUDA's
