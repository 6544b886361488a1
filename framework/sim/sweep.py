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
whose model states do not fit ranks last), drawn in `simulated_search.png` (MFU against
memory per GPU, out-of-memory layouts marked), and none is launched: the cluster is not here.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Optional

from framework.config import ConfigError, RunConfig, read_config, to_yaml
from framework.report.files import write_atomic

PREDICTION = "prediction.json"
RESULT = "simulated_search.json"
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
    from framework.sim.cost.price import describe

    rep = predict_run(run, vocab)
    lay = rep["layout"]
    return {**rep, "status": "simulated", "schedule": lay["schedule"], "pp": lay["pp"], "microbatches":
            lay["microbatches"], "predicted_step_time_s": rep["step_s"],
            "predicted_tokens_per_s": rep["tokens_per_s_per_gpu"] * rep["gpus"] if rep["fits"] else 0.0,
            "predicted_bubble_fraction": rep["bubble"], "line": describe(rep),
            "ranked_by": rep["tokens_per_s_per_gpu"] if rep["fits"] else 0.0}  # per GPU: worlds may differ


def finish(sweep_dir: str, run_job) -> list[dict]:
    """Rank the sweep's predictions, run the top_k (`run_job(run, job_dir)`), write the table."""
    rows = []
    for path in sorted(glob.glob(os.path.join(sweep_dir, "*", PREDICTION))):
        try:
            with open(path) as f:
                row = json.load(f)
            float(row["predicted_tokens_per_s"])
        except (OSError, ValueError, TypeError, KeyError) as e:  # a damaged job directory: not a candidate
            print(f"WARNING: {path}: unreadable ({type(e).__name__}): left out of the ranking", flush=True)
            continue
        rows.append({"job_dir": os.path.dirname(path), **row})
    if not rows:
        return []
    rows.sort(key=lambda r: -r.get("ranked_by", r["predicted_tokens_per_s"]))
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
              f"m={row['microbatches']}) in {row['job_dir']}", flush=True)
        try:
            summary = run_job(run, row["job_dir"])
        except Exception as e:  # noqa: BLE001 - one failed run never stops the others
            row["measured_status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            continue
        row["measured_status"] = "completed"
        row["measured_step_time_s"], row["measured_bubble_fraction"] = summary["step_time_s"], summary["bubble_fraction"]
        row["step_time_error"] = row["predicted_step_time_s"] / summary["step_time_s"] - 1
        row["bubble_error"] = row["predicted_bubble_fraction"] - summary["bubble_fraction"]
        # the run set the search's prediction aside with its other earlier files: it belongs beside the result
        prediction = {k: v for k, v in row.items() if k not in ("job_dir",)}
        write_atomic(os.path.join(row["job_dir"], PREDICTION), json.dumps(prediction, indent=1))
        write_atomic(table, json.dumps(rows, indent=1))
    print(f"search.mode=simulate: {len(rows)} candidates predicted, {min(k, len(rows))} run; {table}"
          + (" and simulated_search.png (a cluster's: nothing runs here)" if "hardware" in rows[0] else ""), flush=True)
    return rows


def cluster_plot(rows: list[dict], path: str) -> None:
    """MFU against memory per GPU (states + activations), one point per candidate, out-of-memory ones
    marked, the device's memory as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for fits, marker, label in ((True, "o", "fits"), (False, "x", "out of memory")):
        pick = [r for r in rows if r["fits"] == fits]
        if pick:
            ax.scatter([r["memory_per_gpu_bytes"] / 2 ** 30 for r in pick], [100 * r["mfu"] for r in pick],
                       marker=marker, label=label, color="tab:blue" if fits else "tab:red")
    ax.axvline(rows[0]["memory_bytes"] / 2 ** 30, color="gray", linestyle="--", label="GPU memory")
    for r in rows[:3]:
        lay = r["layout"]
        ax.annotate(f"#{r['predicted_rank']} tp{lay['tp']} pp{lay['pp']} dp{lay['dp']} z{lay['zero']}",
                    (r["memory_per_gpu_bytes"] / 2 ** 30, 100 * r["mfu"]), fontsize=8)
    ax.set_xlabel("memory per GPU (GiB: model states + saved activations)")
    ax.set_ylabel("predicted MFU (%)")
    ax.set_title(f"{len(rows)} layouts on {rows[0]['hardware']} (cost model)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
