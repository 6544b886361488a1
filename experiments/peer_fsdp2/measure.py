"""Our ZeRO (framework/parallel/zero.py) beside torch's FSDP2 (parallelism.zero_impl=fsdp2) on
this machine: tokens/s, per-rank memory and the bytes each back end's collectives move per step.

Runs `python run.py` on gpt2-tiny (Psi = 859,008 with the byte tokenizer), pycode, 16
sequences of 128 tokens per step (dp 2: micro-batch 4 x 2 per rank; dp 4: 4 x 1), AdamW,
12 steps (medians over steps 4-12), for zero 2 / 3 at dp 2 / 4, each back end in fp32 and
bf16-mixed; REPEATS times, interleaved. Writes results.json to out_dir.

Bytes communicated are COUNTED, not computed: a `sitecustomize.py` put on PYTHONPATH wraps
torch.distributed's all_gather_into_tensor / all_gather_single / reduce_scatter_tensor /
reduce_scatter_single / all_reduce in every rank (before the framework or FSDP2 bind them)
and adds up, per operation, the logical payload of each call on this rank: an all-gather's
output, a reduce-scatter's input, an all-reduce's buffer (the whole unsharded tensor a
collective is about; what one rank sends on a ring is (N-1)/N of it for an all-gather or a
reduce-scatter and 2(N-1)/N for an all-reduce). With checkpointing, evaluation and the final
export off, every collective of a run is a training step's, so total / steps is per step.

    python experiments/peer_fsdp2/measure.py [out_dir]     # default: outputs/peer_fsdp2
    python experiments/peer_fsdp2/measure.py --table results.json   # the README's table
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
COMMON = ["model=gpt2-tiny", "data=pycode", "data.max_files=100", "data.seq_len=128", "logger=none",
          f"trainer.steps={STEPS}", "trainer.micro_batch_size=4", "metrics.skip_first=3",
          f"trainer.log_interval={STEPS}", "schedule=flush", "trainer.save_checkpoint=false"]
DP = {2: ["parallelism=dp2", "schedule.microbatches=2"], 4: ["parallelism=dp4", "schedule.microbatches=1"]}
CASES = [(impl, prec, dp, z) for prec in ("fp32", "bf16-mixed") for impl in ("ours", "fsdp2") for dp in (2, 4)
         for z in (2, 3)]
REPEATS = 3
MiB = 2 ** 20

SHIM = '''
import json, os
if os.environ.get("COMM_COUNT_DIR"):
    # Imported by the forkserver before the framework (ranks are its forks): the wrappers are
    # in place when tp_comm.py and FSDP2 look the functions up. Ranks end with os._exit, so
    # each dumps its counts when it destroys its process group (framework/train/worker.py).
    import torch.distributed as dist
    _counts = {}
    def _wrap(name, size_of):
        fn = getattr(dist, name, None)
        if fn is None:
            return
        def inner(*a, **k):
            t = size_of(a, k)
            c = _counts.setdefault(name, [0, 0])
            c[0] += 1
            c[1] += t.numel() * t.element_size()
            return fn(*a, **k)
        setattr(dist, name, inner)
    for n in ("all_gather_into_tensor", "all_gather_single"):  # (output, input): the gathered size
        _wrap(n, lambda a, k: k.get("output_tensor", k.get("output", a[0] if a else None)))
    for n in ("reduce_scatter_tensor", "reduce_scatter_single"):  # (output, input): the whole input
        _wrap(n, lambda a, k: k.get("input", k.get("input_tensor", a[1] if len(a) > 1 else None)))
    _wrap("all_reduce", lambda a, k: k.get("tensor", a[0] if a else None))
    _destroy = dist.destroy_process_group
    def _dump_and_destroy(*a, **k):
        if os.environ.get("RANK") is not None:
            path = os.path.join(os.environ["COMM_COUNT_DIR"], f"rank{os.environ['RANK']}.json")
            with open(path, "w") as f:
                json.dump(_counts, f)
        return _destroy(*a, **k)
    dist.destroy_process_group = _dump_and_destroy
'''


def run_case(impl: str, prec: str, dp: int, zero: int, job: Path, shim: str) -> dict:
    comm = job / "comm"
    comm.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([shim, str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "COMM_COUNT_DIR": str(comm)}
    cmd = [sys.executable, str(ROOT / "run.py"), *COMMON, *DP[dp], f"parallelism.zero={zero}",
           f"parallelism.zero_impl={impl}", f"trainer.precision={prec}", f"hydra.run.dir={job}"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    summary = json.loads((job / "summary.json").read_text())
    counts = [json.loads((comm / f"rank{r}.json").read_text()) for r in range(dp)]
    per_step = {op: c[1] / STEPS for op, c in counts[0].items()}  # rank 0 (every rank issues the same)
    calls = {op: c[0] / STEPS for op, c in counts[0].items()}
    ranks = [{k: r[k] for k in ("rank", "psi", "params_bytes", "grads_bytes", "master_bytes", "optimizer_bytes",
                                "model_state_formula_bytes", "model_state_formula_bf16_bytes",
                                "zero_transient_peak_bytes", "activation_peak_bytes", "rss_peak_bytes")}
             for r in summary["ranks"]]
    return {"impl": impl, "precision": prec, "dp": dp, "zero": zero, "tokens_per_s": summary["tokens_per_s"],
            "step_time_s": summary["step_time_s"], "fwd_bwd_s": summary["fwd_bwd_s"],
            "optimizer_s": summary["optimizer_s"], "loss": summary["loss"], "ranks": ranks,
            "comm_bytes_per_step": per_step, "comm_calls_per_step": calls}


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def table(results: dict) -> str:
    """One row per case: medians over the repeats (min - max for tokens/s); the rank with the
    most model-state bytes; communication of rank 0 (every rank issues the same collectives)."""
    rows = ["| back end | precision | dp | zero | tokens/s median (min - max) | fwd+bwd / optimizer s | model states "
            "per rank MiB (params / grads / master / optim) | transient peak MiB | peak RSS MiB (max rank) | all-gather / "
            "reduce-scatter / all-reduce MiB per step (calls) | final loss |", "|" + "---|" * 11]
    for impl, prec, dp, z in CASES:
        runs = [r for r in results["runs"] if (r["impl"], r["precision"], r["dp"], r["zero"]) == (impl, prec, dp, z)]
        if not runs:
            continue
        tps = [r["tokens_per_s"] for r in runs]
        parts = ("params_bytes", "grads_bytes", "master_bytes", "optimizer_bytes")
        st = max(runs[0]["ranks"], key=lambda x: sum(x.get(k, 0) for k in parts))
        states = sum(st.get(k, 0) for k in parts)
        comm, calls = runs[0]["comm_bytes_per_step"], runs[0]["comm_calls_per_step"]

        def op(*names):
            b = sum(comm.get(n, 0) for n in names)
            c = sum(calls.get(n, 0) for n in names)
            return f"{b / MiB:.2f} ({c:g})"

        rows.append(f"| {impl} | {prec} | {dp} | {z} | {_median(tps):,.0f} ({min(tps):,.0f} - {max(tps):,.0f}) | "
                    f"{_median([r['fwd_bwd_s'] for r in runs]):.3f} / {_median([r['optimizer_s'] for r in runs]):.3f} | "
                    f"{states / MiB:.3f} ({st['params_bytes'] / MiB:.3f} / {st['grads_bytes'] / MiB:.3f} / "
                    f"{st.get('master_bytes', 0) / MiB:.3f} / {st['optimizer_bytes'] / MiB:.3f}) | {st['zero_transient_peak_bytes'] / MiB:.3f} | "
                    f"{_median([max(x['rss_peak_bytes'] for x in r['ranks']) for r in runs]) / MiB:.0f} | "
                    f"{op('all_gather_into_tensor', 'all_gather_single')} / "
                    f"{op('reduce_scatter_tensor', 'reduce_scatter_single')} / {op('all_reduce')} | "
                    f"{runs[0]['loss']:.4f} |")
    return "\n".join(rows)


def plot(results: dict, path: Path) -> None:
    """peer_fsdp2.png: tokens/s (median, min - max) and the largest rank's model states per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in CASES if any((r["impl"], r["precision"], r["dp"], r["zero"]) == c for r in results["runs"])]
    labels = [f"{i}\n{p}\ndp{d} z{z}" for i, p, d, z in cases]
    parts = ("params_bytes", "grads_bytes", "master_bytes", "optimizer_bytes")
    tps, lo, hi, states = [], [], [], []
    for c in cases:
        runs = [r for r in results["runs"] if (r["impl"], r["precision"], r["dp"], r["zero"]) == c]
        t = [r["tokens_per_s"] for r in runs]
        tps.append(_median(t))
        lo.append(_median(t) - min(t))
        hi.append(max(t) - _median(t))
        states.append(max(sum(x.get(k, 0) for k in parts) for x in runs[0]["ranks"]) / MiB)
    colours = ["#4292c6" if c[0] == "ours" else "#fd8d3c" for c in cases]
    fig, (a, b) = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
    a.bar(range(len(cases)), tps, yerr=[lo, hi], color=colours, capsize=3)
    a.set(ylabel="tokens/s (median, min-max of repeats)", title="ours (blue) vs FSDP2 (orange), gpt2-tiny, 2 CPU cores, gloo")
    b.bar(range(len(cases)), states, color=colours)
    b.set(ylabel="model states, largest rank (MiB)")
    b.set_xticks(range(len(cases)), labels, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if sys.argv[1:2] == ["--table"]:
        results = json.loads(Path(sys.argv[2]).read_text())
        print(table(results))
        plot(results, Path(__file__).with_name("peer_fsdp2.png"))
        return
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "outputs" / "peer_fsdp2")
    shim = tempfile.mkdtemp(prefix="comm_shim_")
    Path(shim, "sitecustomize.py").write_text(SHIM)
    results = []
    for i in range(REPEATS):
        for impl, prec, dp, z in CASES:
            r = run_case(impl, prec, dp, z, out / f"run{i + 1}" / f"{impl}_{prec}_dp{dp}_zero{z}", shim)
            r["repeat"] = i + 1
            results.append(r)
            print(f"{impl:5} {prec:10} dp {dp} zero {z}: {r['tokens_per_s']:,.0f} tok/s, "
                  f"comm/step {sum(r['comm_bytes_per_step'].values()) / 2**20:.2f} MiB", flush=True)
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())
    import torch

    machine = {"cpu": cpu, "cores": os.cpu_count(), "gpu": None, "torch": torch.__version__, "backend": "gloo"}
    (out / "results.json").write_text(json.dumps({"machine": machine, "runs": results}, indent=1))
    print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
