"""The cost model's report as the lines a user reads (the dry run with `hardware=...`,
`python -m framework.simulate hardware=...`, a cluster sweep): the step, tokens/s per GPU and
the cluster's, MFU, communication, and the fullest rank's memory with every part named, so
the parts add up to the total as printed (framework/sim/cost/price.py makes the report)."""

from __future__ import annotations


def memory_line(rep: dict) -> str:
    """The fullest rank's memory and every part of it, so the parts add up to the total (a
    report written before the parts were kept: the maxima, as then)."""
    parts = rep.get("memory_parts_bytes") or {"model_states": rep["model_state_bytes_max"],
                                              "activations": rep["activation_peak_bytes_max"],
                                              "recompute_transient": rep.get("recompute_transient_bytes", 0)}
    names = {"model_states": "model states", "activations": "saved activations",
             "recompute_transient": "recomputation transient"}
    shown = {k: v for k, v in parts.items() if v or k != "recompute_transient"}
    tenths = _tenths(list(shown.values()), rep["memory_per_gpu_bytes"])
    terms = " + ".join(f"{names[k]} {t / 10:.1f}" for k, t in zip(shown, tenths))
    rank = f" on pp rank {rep['memory_fullest_pp_rank']}" if "memory_fullest_pp_rank" in rep else ""
    return (f"memory {rep['memory_per_gpu_bytes'] / 2 ** 30:.1f} of {rep['memory_bytes'] / 2 ** 30:.1f} GiB per GPU"
            f"{rank} = {terms} GiB ({'fits' if rep['fits'] else 'OUT OF MEMORY'})")


def host_line(rep: dict) -> str:
    """ZeRO-Offload's host side: the node's offloaded states against its host memory."""
    if "host_state_bytes_per_node" not in rep:
        return ""
    have = rep.get("host_memory_bytes")
    fit = "no host memory in the profile" if have is None else (
        f"of {have / 2 ** 30:.1f} GiB, {'fits' if rep['fits_host'] else 'OUT OF HOST MEMORY'}")
    line = f" | host {rep['host_state_bytes_per_node'] / 2 ** 30:.1f} GiB per node offloaded ({fit})"
    if "nvme_state_bytes_per_node" in rep:
        room = {None: "no drives in the profile", True: "fits", False: "OUT OF DRIVE SPACE"}[rep["fits_nvme"]]
        line += f", drives {rep['nvme_state_bytes_per_node'] / 2 ** 30:.1f} GiB per node ({room})"
    return line


def _tenths(parts: list[float], total: float) -> list[int]:
    """Each part in tenths of a GiB, rounded so they add to the rounded total (largest
    remainders get the leftover tenths) where the parts add to the total."""
    exact = [v / 2 ** 30 * 10 for v in parts]
    out = [int(x) for x in exact]
    left = round(total / 2 ** 30 * 10) - sum(out)
    for i in sorted(range(len(exact)), key=lambda i: out[i] - exact[i])[:max(0, left)]:
        out[i] += 1
    return out


def describe(rep: dict) -> str:
    """The dry run's line. Tokens/s per GPU (`tokens_per_s_per_gpu`) and the layout's total
    (`tokens_per_s_cluster`, all its GPUs); a layout that does not fit is priced as if it did,
    and says so first."""
    hidden = rep.get("comm_hidden_s") or {}
    comm = ", ".join(f"{k} {v * 1e3:.1f} ms" + (f" (+{hidden[k] * 1e3:.1f} ms hidden by overlap)" if hidden.get(k)
                                                 else "") for k, v in rep["comm_s"].items() if v)
    cluster = rep.get("tokens_per_s_cluster", rep["tokens_per_s_per_gpu"] * rep["gpus"])
    oom = "" if rep["fits"] else f"{rep.get('oom_reason') or 'OUT OF MEMORY'}; priced as if it fit: "
    return (f"cost model on {rep['hardware']} ({rep['source']}): {oom}step {rep['step_s'] * 1e3:.1f} ms | "
            f"{rep['tokens_per_s_per_gpu']:.0f} tokens/s and {rep['tflops_per_gpu']:.1f} TFLOP/s per GPU, "
            f"{cluster:,.0f} tokens/s on the {rep['gpus']} GPUs | MFU "
            f"{rep['mfu']:.1%} (HFU {rep['hfu']:.1%}, {rep['dtype']} peak) | bubble {rep['bubble']:.3f} | "
            f"communication {comm or 'none'} | optimizer {rep['optimizer_s'] * 1e3:.1f} ms | {memory_line(rep)}"
            f"{host_line(rep)}"
            f"\n  assumed: {rep['assumptions']}")
