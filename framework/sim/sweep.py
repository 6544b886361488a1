"""search.mode=simulate: a sweep whose jobs are predicted, not run, and then only the best
`search.top_k` of them run.

    python run.py -m schedule=<name>,<name>,... schedule.microbatches=4,8 \
        search.mode=simulate sim.from=<finished pipeline job> search.top_k=1

Each job of the sweep is validated as usual (a layout that cannot run is rejected; one whose
model states, per the dry-run planner, plus the predicted activation peak exceed
`search.memory_budget_bytes` is rejected too), predicted from sim.from's calibration
(framework/sim/cli.py) and written as `prediction.json` (plus its config.yaml); no rank
starts. The sweeper receives the prediction of its objective (`predicted_tokens_per_s` for
tokens_per_s, `predicted_step_time_s` for step_time_s). When the sweep ends
(`SimulatedSearch.finish`, from the Hydra callback) the candidates are ranked by predicted
tokens/s (the same order as step time when tokens per step are equal, as in a layout search
with trainer.global_batch_size; fair when they differ), the top_k are launched in their own
job directories, and `simulated_search.json` in the sweep directory lists every candidate
with its prediction and, for those run, the measurement and the signed error.

With `hardware=<profile>` instead of sim.from, each candidate is priced by the cost model
for that cluster (framework/sim/cost/plan.py; no meta-model build, no launch-size check),
ranked by tokens/s per GPU (layouts of one cluster may use different numbers of GPUs; one
that does not fit ranks last, with no predicted speed and its `reason`), drawn in
`simulated_search.png` (MFU against memory per GPU, out-of-memory layouts marked, every
point labelled apart), and none is launched: the cluster is not here. Tokens/s names say
which: `predicted_tokens_per_s_per_gpu`, `predicted_tokens_per_s_cluster` (all the layout's
GPUs; `predicted_tokens_per_s` is its older name), docs/cost_model.md.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Optional

from framework.config import ConfigError, RunConfig, read_config, to_yaml
from framework.report.files import set_aside_previous
from framework.files import write_atomic
from framework.report.progress import RUN_LOG

PREDICTION = "prediction.json"
RESULT = "simulated_search.json"
OWN_FILES = (PREDICTION, "config.yaml", RUN_LOG)  # what the prediction phase wrote in a job's directory
OBJECTIVES = {"tokens_per_s": "predicted_tokens_per_s", "step_time_s": "predicted_step_time_s"}


def predict_job(run: RunConfig, job_dir: str, model_state_bytes: Optional[int], vocab: int) -> dict:
    """One candidate: its prediction, checked against the memory budget, in prediction.json."""
    if run.hardware.name != "none":
        return _write(run, job_dir, cluster_prediction(run, vocab))
    from framework.sim.cli import what_if

    result = what_if(run.sim.source, target=run)
    result.pop("_predicted")
    budget = run.search.memory_budget_bytes
    need = (model_state_bytes or 0) + max(result["predicted_activation_peak_bytes"])
    result.update(status="simulated", model_state_bytes_max=model_state_bytes, predicted_memory_bytes_max=need)
    if budget is not None and need > budget:
        raise ConfigError("search.memory_budget_bytes", budget,
                          f"this layout needs about {need:,.0f} bytes on its fullest rank (model states from the "
                          "dry-run planner + the simulator's activation peak)", "raise the budget, or shard more")
    return _write(run, job_dir, result)


def _write(run: RunConfig, job_dir: str, result: dict) -> dict:
    os.makedirs(job_dir, exist_ok=True)
    with open(os.path.join(job_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(run))
    write_atomic(os.path.join(job_dir, PREDICTION), json.dumps(result, indent=1))
    return result


def cluster_prediction(run: RunConfig, vocab: int) -> dict:
    """The cost model's price of one candidate on `hardware` (framework/sim/cost/plan.py),
    under the keys the ranking reads. A layout whose memory (model states + activations) does not fit is kept and
    marked (`fits` false): the ranking and the plot show it, never launch anything."""
    from framework.sim.cost.plan import predict_run
    from framework.sim.cost.describe import describe

    rep = predict_run(run, vocab)
    lay, fits = rep["layout"], rep["fits"]
    # a layout that does not fit predicts no speed (null, not 0.0): it cannot run; `reason` says why
    per_gpu, cluster = (rep["tokens_per_s_per_gpu"], rep["tokens_per_s_cluster"]) if fits else (None, None)
    return {**rep, "status": "simulated", "reason": rep["oom_reason"], "schedule": lay["schedule"], "pp": lay["pp"],
            "microbatches": lay["microbatches"], "predicted_step_time_s": rep["step_s"] if fits else None,
            "predicted_tokens_per_s_per_gpu": per_gpu, "predicted_tokens_per_s_cluster": cluster,
            "predicted_tokens_per_s": cluster,  # the older name of the cluster's total (docs/cost_model.md)
            "predicted_bubble_fraction": rep["bubble"], "line": describe(rep),
            "ranked_by": per_gpu}  # per GPU: worlds may differ


def _rank_key(row: dict) -> tuple:
    """Fastest first; a candidate with no predicted speed (out of memory) after every one
    with, the closest to fitting first."""
    speed = row.get("ranked_by", row.get("predicted_tokens_per_s"))
    return (speed is None, -(speed or 0.0), row.get("memory_per_gpu_bytes") or 0.0)


def _readable(row: dict) -> None:
    """A candidate's speed is a number, or null with the reason it has none."""
    speed = row["predicted_tokens_per_s"]
    if speed is None:
        if not row.get("reason"):
            raise ValueError("no predicted speed and no reason")
    else:
        float(speed)


def finish(sweep_dir: str, run_job) -> list[dict]:
    """Rank the sweep's predictions, run the top_k (`run_job(run, job_dir)`), write the table."""
    rows = []
    for path in sorted(glob.glob(os.path.join(sweep_dir, "*", PREDICTION))):
        try:
            with open(path) as f:
                row = json.load(f)
            _readable(row)
        except (OSError, ValueError, TypeError, KeyError) as e:  # a damaged job directory: not a candidate
            print(f"WARNING: {path}: unreadable ({type(e).__name__}): left out of the ranking", flush=True)
            continue
        rows.append({"job_dir": os.path.dirname(path), **row})
    if not rows:
        return []
    rows.sort(key=_rank_key)
    k = read_config(os.path.join(rows[0]["job_dir"], "config.yaml")).search.top_k
    if "hardware" in rows[0]:  # a cluster's candidates: ranked and drawn; the cluster is not here to run them
        k = 0
    for rank, row in enumerate(rows):
        row["predicted_rank"] = rank + 1
        row["launched"] = rank < k
    table = os.path.join(sweep_dir, RESULT)
    write_atomic(table, json.dumps(rows, indent=1))  # the ranking first: a stop during the runs keeps it
    if "hardware" in rows[0]:
        cluster_plot(rows, os.path.join(sweep_dir, "simulated_search.png"))
    for row in rows[:k]:
        run = read_config(os.path.join(row["job_dir"], "config.yaml"))
        run.search.mode = "run"
        print(f"search.mode=simulate: running predicted #{row['predicted_rank']} ({row['schedule']}, pp={row['pp']}, "
              f"m={row['microbatches']}) in {row['job_dir']}, beside its prediction", flush=True)
        # this sweep's own prediction files are no earlier run's: they stay (anything else is set aside)
        set_aside_previous(row["job_dir"], keep=OWN_FILES)
        try:
            summary = run_job(run, row["job_dir"], set_aside=False)
        except Exception as e:  # noqa: BLE001 - one failed run never stops the others
            row["measured_status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            continue
        row["measured_status"] = "completed"
        row["measured_step_time_s"], row["measured_bubble_fraction"] = summary["step_time_s"], summary["bubble_fraction"]
        row["step_time_error"] = row["predicted_step_time_s"] / summary["step_time_s"] - 1
        row["bubble_error"] = row["predicted_bubble_fraction"] - summary["bubble_fraction"]
        # the prediction with its measurement beside the result
        prediction = {k: v for k, v in row.items() if k not in ("job_dir",)}
        write_atomic(os.path.join(row["job_dir"], PREDICTION), json.dumps(prediction, indent=1))
        write_atomic(table, json.dumps(rows, indent=1))
    oom = sum(1 for r in rows if r.get("fits") is False)
    print(f"search.mode=simulate: {len(rows)} candidates predicted, {min(k, len(rows))} run"
          + (f", {oom} out of memory (no predicted speed; `reason` in the table)" if oom else "") + f"; {table}"
          + (" and simulated_search.png (a cluster's: nothing runs here)" if "hardware" in rows[0] else ""), flush=True)
    return rows


LABEL_KEYS = ("schedule", "tp", "pp", "dp", "cp", "ep", "zero")  # always named (cp, ep: past 1)
SHORT = {"zero": "z", "microbatches": "m", "virtual_stages": "v", "micro_batch_size": "mbs", "seq_len": "s",
         "sequence_parallel": "sp", "recompute": "ac", "recompute_mode": "recompute="}


def _part(lay: dict, k: str) -> str:
    v, short = lay.get(k), SHORT.get(k, k)
    if k == "schedule":
        return str(v)
    if k in ("cp", "ep") and (v or 1) == 1:
        return ""
    if isinstance(v, bool):
        return short if v else f"no-{short}"
    return f"{short}{v}"


def point_labels(rows: list[dict]) -> list[str]:
    """Each candidate's label in the plot: its rank, the layout's main keys and every other
    layout key whose value differs between candidates; two candidates alike in all of those
    (they differ outside the layout, e.g. the precision) get their job directory's name too."""
    lays = [r["layout"] for r in rows]
    varying = [k for k in lays[0] if k not in LABEL_KEYS and len({str(lay.get(k)) for lay in lays}) > 1]
    texts = [" ".join(filter(None, (_part(lay, k) for k in (*LABEL_KEYS, *varying)))) for lay in lays]
    alike = {t for t in texts if texts.count(t) > 1}
    texts = [f"{t} (job {os.path.basename(r.get('job_dir') or str(i))})" if t in alike else t
             for i, (r, t) in enumerate(zip(rows, texts))]
    return [f"#{r['predicted_rank']} {t}" for r, t in zip(rows, texts)]


def cluster_plot(rows: list[dict], path: str) -> dict:
    """MFU against memory per GPU (states + activations), one point per candidate, out-of-memory ones
    marked (at the MFU they would reach if they fit), the device's memory as a line. Every point
    carries its rank; the list beside the axes names each rank's layout (`point_labels`).
    Returns what it wrote: {"points": each point's text, "key": the list}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = point_labels(rows)
    fig, ax = plt.subplots(figsize=(10.5, max(4.5, 1.5 + 0.16 * len(rows))))
    for fits, marker, label in ((True, "o", "fits"), (False, "x", "out of memory")):
        pick = [r for r in rows if r["fits"] == fits]
        if pick:
            ax.scatter([r["memory_per_gpu_bytes"] / 2 ** 30 for r in pick], [100 * r["mfu"] for r in pick],
                       marker=marker, label=label, color="tab:blue" if fits else "tab:red")
    ax.axvline(rows[0]["memory_bytes"] / 2 ** 30, color="gray", linestyle="--", label="GPU memory")
    for r in rows:
        ax.annotate(f"#{r['predicted_rank']}", (r["memory_per_gpu_bytes"] / 2 ** 30, 100 * r["mfu"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    key = "\n".join(f"{lab}{'' if r['fits'] else '  (OOM)'}" for r, lab in zip(rows, labels))
    fig.text(0.63, 0.95, key, va="top", ha="left", fontsize=7, family="monospace")
    ax.set_xlabel("memory per GPU (GiB: model states + saved activations)")
    ax.set_ylabel("predicted MFU (%; out of memory: if it fit)")
    ax.set_title(f"{len(rows)} layouts on {rows[0]['hardware']} (cost model)")
    ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.07, right=0.6, top=0.92, bottom=0.1)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"points": [t.get_text() for t in ax.texts], "key": key}
