"""How accurate is the simulator on this machine? Replay and transfer errors, and the spread
of identical runs beside them.

Grid (each case one run of run.py, 20 steps, 3 warm-up, synthetic data, untied embedding so
1f1b / 2bw run too):
- pp 2 (2 ranks, one core each): every registered schedule that runs at pp 2, m in {2, 4,
  8}, on gpt2-tiny (4 blocks, width 128) and a larger model (8 blocks, width 256);
- a deliberately slow stage (debug.stage_delay_ms=15 on pp rank 1) for flush, zbh1,
  interleaved at m 4;
- three identical runs of flush m 4 (both models): the run-to-run spread;
- pp 4 (4 ranks on 2 cores: oversubscribed; 8 blocks of width 128) for flush, zbh1, interleaved at m 8, reported
  beside, not held to the targets.
Replay: each run's own predicted_step_time_s / predicted_bubble_fraction (summary.json).
Transfer: `framework.sim.cli.what_if` from the model's first flush m 4 run, for every other
case of that model and pp 2 (no stage delay). Ranking: for each model and m, every pair of
schedules whose measured step times differ by more than the measured spread; preserved
when the prediction orders them the same way.

    python experiments/simulator/accuracy.py [out_dir]        (resumes: a case with a summary is kept)
    python experiments/simulator/accuracy.py [out_dir] --table  (only the table)
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from itertools import combinations
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from framework.schedules import get, names  # noqa: E402
from framework.sim.cli import what_if  # noqa: E402

BASE = ["data=synthetic", "logger=none", "trainer.steps=20", "metrics.skip_first=3", "trainer.micro_batch_size=8",
        "model.tie_embeddings=false"]
MODELS = {"tiny": ["model.n_layer=4", "model.n_embd=128"], "larger": ["model.n_layer=8", "model.n_embd=256"],
          "tiny8": ["model.n_layer=8", "model.n_embd=128"]}  # tiny8: pp 4 (interleaved needs 8 blocks)
MS = (2, 4, 8)


def pp2_schedules() -> list[str]:
    out = []
    for n in names():
        s = get(n)
        if s.why_not(2, 4, s.preset_chunks) is None:
            out.append(n)
    return out


def cases() -> list[dict]:
    out = []
    for model in ("tiny", "larger"):
        for rep in range(3):
            out.append(dict(model=model, schedule="flush", m=4, pp=2, delay=0, rep=rep))
        for name in pp2_schedules():
            for m in MS:
                s = get(name)
                if s.why_not(2, m, s.preset_chunks) is None and not (name == "flush" and m == 4):
                    out.append(dict(model=model, schedule=name, m=m, pp=2, delay=0, rep=0))
    for name in ("flush", "zbh1", "interleaved"):
        out.append(dict(model="tiny", schedule=name, m=4, pp=2, delay=15, rep=0))
        out.append(dict(model="tiny8", schedule=name, m=8, pp=4, delay=0, rep=0))
    return out


def job_dir(out: Path, c: dict) -> Path:
    return out / f"{c['model']}-pp{c['pp']}-{c['schedule']}-m{c['m']}-d{c['delay']}-r{c['rep']}"


def run_case(out: Path, c: dict) -> None:
    d = job_dir(out, c)
    if (d / "summary.json").exists():
        return
    args = [*BASE, *MODELS[c["model"]], f"parallelism=pp{c['pp']}", f"schedule={c['schedule']}",
            f"schedule.microbatches={c['m']}", f"hydra.run.dir={d}"]
    if c["delay"]:
        args += [f"debug.stage_delay_ms={c['delay']}", "debug.delay_pp_rank=1"]
    r = subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, capture_output=True, text=True)
    print(f"{d.name}: exit {r.returncode}", flush=True)


def pct(x: float) -> str:
    return f"{100 * x:+.1f} %"


def table(out: Path) -> str:
    rows = []
    for c in cases():
        p = job_dir(out, c) / "summary.json"
        if p.exists():
            s = json.loads(p.read_text())
            if s.get("status") == "completed":
                rows.append((c, s, job_dir(out, c)))
    lines = ["## Replay (durations from the same run)", "",
             "| model | pp | schedule | m | stage delay ms | measured step ms | predicted ms | error "
             "| measured bubble | predicted | error (points) |", "|" + "---|" * 11]
    replay = {"pp2": [], "pp4": []}
    for c, s, _ in rows:
        e, be = s["predicted_step_time_error"], s["predicted_bubble_error"]
        replay["pp4" if c["pp"] == 4 else "pp2"].append((e, be))
        lines.append(f"| {c['model']} | {c['pp']} | {c['schedule']}{'' if not c['rep'] else ' (repeat)'} | {c['m']} "
                     f"| {c['delay']} | {s['step_time_s'] * 1e3:.1f} | {s['predicted_step_time_s'] * 1e3:.1f} | {pct(e)} "
                     f"| {s['bubble_fraction']:.3f} | {s['predicted_bubble_fraction']:.3f} | {100 * be:+.1f} |")
    lines += ["", _summary("replay, pp 2", replay["pp2"]), _summary("replay, pp 4 (oversubscribed)", replay["pp4"]), ""]
    spread = {}
    for model in MODELS:
        reps = [s["step_time_s"] for c, s, _ in rows if c["model"] == model and c["schedule"] == "flush"
                and c["m"] == 4 and c["pp"] == 2 and not c["delay"]]
        if len(reps) > 1:
            spread[model] = (max(reps) - min(reps)) / statistics.median(reps)
            lines.append(f"Run-to-run spread, {model}, flush m 4, {len(reps)} identical runs: step time "
                         f"{', '.join(f'{x * 1e3:.1f}' for x in reps)} ms, (max - min) / median = {100 * spread[model]:.1f} %.")
    lines += ["", "## Transfer (durations from the model's first flush m 4 run)", "",
              "| model | schedule | m | measured step ms | predicted ms | error | measured bubble | predicted | error (points) |",
              "|" + "---|" * 9]
    transfer, by_group = [], {}
    for model in MODELS:
        src = next((d for c, s, d in rows if c["model"] == model and c["schedule"] == "flush" and c["m"] == 4
                    and c["pp"] == 2 and not c["delay"] and c["rep"] == 0), None)
        if src is None:
            continue
        for c, s, d in rows:
            if c["model"] != model or c["pp"] != 2 or c["delay"] or c["rep"] or d == src:
                continue
            sched = get(c["schedule"])
            p = what_if(str(src), [f"schedule={c['schedule']}", f"schedule.microbatches={c['m']}",
                                   f"schedule.virtual_stages={sched.preset_chunks}"])
            e = p["predicted_step_time_s"] / s["step_time_s"] - 1
            be = p["predicted_bubble_fraction"] - s["bubble_fraction"]
            transfer.append((e, be))
            by_group.setdefault((model, c["m"]), []).append((c["schedule"], s["step_time_s"], p["predicted_step_time_s"]))
            lines.append(f"| {model} | {c['schedule']} | {c['m']} | {s['step_time_s'] * 1e3:.1f} "
                         f"| {p['predicted_step_time_s'] * 1e3:.1f} | {pct(e)} | {s['bubble_fraction']:.3f} "
                         f"| {p['predicted_bubble_fraction']:.3f} | {100 * be:+.1f} |")
    lines += ["", _summary("transfer", transfer), ""]
    kept = total = 0
    flipped = []
    for (model, m), group in by_group.items():
        for (a, ma, pa), (b, mb, pb) in combinations(group, 2):
            if abs(ma - mb) / min(ma, mb) > spread.get(model, 0.0):
                total += 1
                if (ma < mb) == (pa < pb):
                    kept += 1
                else:
                    flipped.append(f"{model} m {m}: {a} {ma * 1e3:.0f} ms vs {b} {mb * 1e3:.0f} ms measured, "
                                   f"{pa * 1e3:.0f} vs {pb * 1e3:.0f} predicted")
    lines.append(f"Ranking: of {total} schedule pairs (same model and m) whose measured step times differ by more "
                 f"than that model's spread, the transfer prediction orders {kept} the same way.")
    lines += [f"- flipped: {f}" for f in flipped]
    return "\n".join(lines) + "\n"


def _summary(label: str, errs: list) -> str:
    if not errs:
        return f"{label}: no runs."
    step = [abs(e) for e, _ in errs]
    bub = [abs(b) for _, b in errs]
    signed = statistics.median(e for e, _ in errs)
    return (f"**{label}** ({len(errs)} runs): step time |error| median {100 * statistics.median(step):.1f} %, max "
            f"{100 * max(step):.1f} % (signed median {pct(signed)}); bubble |error| median "
            f"{100 * statistics.median(bub):.1f} points, max {100 * max(bub):.1f} points.")


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = Path(args[0] if args else ROOT / "outputs" / "simulator_accuracy")
    out.mkdir(parents=True, exist_ok=True)
    if "--table" not in sys.argv:
        for c in cases():
            run_case(out, c)
    text = table(out)
    (out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
