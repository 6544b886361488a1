"""Long sequences on this machine: a tiny Llama at sequence 512 -> 8,192 under context
parallelism (cp 1 / 2 / 4; all-gather, ring and all-to-all; head-tail and contiguous chunks).

Usage (repository root): python experiments/long_context/measure.py [--out DIR] [--steps N] [--repeats R]
    [--only sweep|balance|longest] [--match NAME_PART] [--budget-mib MIB]

Each configuration is `python run.py ...` (fp32, one micro-batch of one sequence, N steps,
median over the steps after the first), R times, alternating configurations within a
repeat so a noisy neighbour hits them alike. Printed per configuration:
- tokens/s: summary.json's median (global tokens per step / the slowest rank's step time),
  median over the repeats and its spread (min-max);
- activation peak per rank: summary.json's `activation_peak_bytes_max` (the ActivationTracker:
  every tensor autograd saves, each storage once; the fullest rank), beside the activation
  model's (framework/sim/cost/activations.py, what `dry_run=true` prints) and its error;
- cp_comm_s and cp_attention_imbalance: the run's medians (framework/metrics/cp.py);
- then, per cp, the longest sequence (a multiple of 512) whose modelled activation peak plus
  model states fits a per-rank budget (--budget-mib), from the model the rows above check.
Machine: 2 CPU cores; cp 4 runs 4 processes on them (oversubscribed), so its tokens/s says
what the CPU share costs, not what cp 4 gains on 4 devices.
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODEL = ["model=llama-tiny", "model.n_layer=2", "model.n_embd=64", "model.n_head=4", "model.n_kv_head=4",
         "model.n_inner=128", "model.max_positions=16384", "trainer.micro_batch_size=1", "schedule.microbatches=1",
         "data=synthetic", "logger=none", "metrics.skip_first=1", "parallelism=single"]
SEQS = (512, 2048, 8192)
CONFIGS = {  # name -> overrides
    "cp1": [],
    "cp2 allgather": ["parallelism.cp=2"],
    "cp2 ring": ["parallelism.cp=2", "parallelism.cp_comm=ring"],
    "cp2 a2a": ["parallelism.cp=2", "parallelism.cp_comm=a2a"],
    "cp4 allgather": ["parallelism.cp=4"],
    "cp4 ring": ["parallelism.cp=4", "parallelism.cp_comm=ring"],
    "cp4 a2a": ["parallelism.cp=4", "parallelism.cp_comm=a2a"],
}
BALANCE = {  # at 4,096 tokens: where the chunks sit
    "cp4 ring headtail": ["parallelism.cp=4", "parallelism.cp_comm=ring"],
    "cp4 ring contiguous": ["parallelism.cp=4", "parallelism.cp_comm=ring", "parallelism.cp_balance=contiguous"],
    "cp4 allgather headtail": ["parallelism.cp=4"],
    "cp4 allgather contiguous": ["parallelism.cp=4", "parallelism.cp_balance=contiguous"],
}


def run(out: Path, tag: str, args: list[str], steps: int) -> dict:
    job = out / tag.replace(" ", "_")
    cmd = [sys.executable, "run.py", *MODEL, *args, f"trainer.steps={steps}", f"hydra.run.dir={job}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{tag}: {r.stderr[-2000:]}")
    return json.loads((job / "summary.json").read_text())


def compose(args: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    from framework.config import load_config

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return load_config(hydra_compose("config", overrides=[*MODEL, *args]))


def modelled_peak(args: list[str]) -> float:
    from framework.sim.cost.activations import peak_bytes
    from framework.sim.cost.price import job_of

    job = job_of(compose(args), 256)  # data=synthetic: 256 token ids
    return max(peak_bytes(job.shape, job.lay, job.pp, job.microbatches, job.schedule, job.virtual_stages))


def states_bytes(args: list[str]) -> float:
    """fp32 parameters, gradients and AdamW's two moments: 16 bytes a parameter (cp replicates them)."""
    from framework.sim.cost.shapes import ModelShape

    return 16 * ModelShape.of(compose(args).model, 256).total_params()


def measure(out: Path, table: dict, seqs, steps: int, repeats: int) -> None:
    keys = [(name, seq) for seq in seqs for name in table]
    got = {k: [] for k in keys}
    for rep in range(repeats):
        for name, seq in keys:
            got[name, seq].append(run(out, f"{name}_{seq}_r{rep}", [*table[name], f"data.seq_len={seq}"], steps))
    print("| seq | layout | tokens/s (spread) | activation peak / rank | model | error | cp_comm_s | imbalance |")
    print("|---|---|---|---|---|---|---|---|")
    for name, seq in keys:
        runs = got[name, seq]
        tps = [r["tokens_per_s"] for r in runs]
        peak = runs[0]["activation_peak_bytes_max"]
        model = modelled_peak([*table[name], f"data.seq_len={seq}"])
        comm = statistics.median(r.get("cp_comm_s") or 0.0 for r in runs)
        imb = [r.get("cp_attention_imbalance") for r in runs]
        imb_s = "-" if imb[0] is None else f"{statistics.median(imb):.2f} ({min(imb):.2f}-{max(imb):.2f})"
        print(f"| {seq:,} | {name} | {statistics.median(tps):,.0f} ({min(tps):,.0f}-{max(tps):,.0f}) | "
              f"{peak / 2**20:,.1f} MiB | {model / 2**20:,.1f} MiB | {model / peak - 1:+.1%} | {comm:.3f} s | {imb_s} |",
              flush=True)


def longest(budget: float) -> None:
    print(f"\n| cp | cp_comm | longest sequence within {budget / 2**20:,.0f} MiB per rank (model) |")
    print("|---|---|---|")
    for cp, comm in ((1, "allgather"), (2, "allgather"), (2, "ring"), (2, "a2a"), (4, "allgather"), (4, "ring"),
                     (4, "a2a")):
        args = [f"parallelism.cp={cp}"] + ([f"parallelism.cp_comm={comm}"] if cp > 1 else [])
        best, seq = 0, 512
        while seq <= 1 << 20:
            a = [*args, f"data.seq_len={seq}", f"model.max_positions={seq}"]
            if modelled_peak(a) + states_bytes(a) > budget:
                break
            best, seq = seq, seq + 512
        print(f"| {cp} | {comm if cp > 1 else '-'} | {best:,} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/long_context")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--budget-mib", type=float, default=256.0)
    ap.add_argument("--only", choices=("sweep", "balance", "longest"))
    ap.add_argument("--match", default="", help="only the configurations whose name contains this")
    o = ap.parse_args()
    out = Path(o.out)
    if o.only in (None, "sweep"):
        measure(out, {k: v for k, v in CONFIGS.items() if o.match in k}, SEQS, o.steps, o.repeats)
    if o.only in (None, "balance"):
        print()
        measure(out, {k: v for k, v in BALANCE.items() if o.match in k}, (4096,), o.steps, o.repeats)
    if o.only in (None, "longest"):
        longest(o.budget_mib * 2**20)


if __name__ == "__main__":
    main()
