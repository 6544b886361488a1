"""`parallelism.cp` (framework/parallel/context_parallel.py): what context parallelism composes
with, checked before any rank starts. Each rejection says why and what to change; what is not
rejected here is proved equal to the single process in fp64 (tests/test_context_parallel.py)."""

from __future__ import annotations

from framework.config import ConfigError, RunConfig
from framework.schedules import never_flushes


def check_context_parallel(run: RunConfig) -> None:
    p, m, key = run.parallelism, run.model, "parallelism.cp"
    if p.cp == 1:
        return
    seq = run.data.seq_len
    if seq % (2 * p.cp):
        raise ConfigError("data.seq_len", seq, f"is cut into 2 x cp = {2 * p.cp} chunks (parallelism.cp={p.cp}: "
                          "each rank an early and a late one)",
                          f"use a multiple of {2 * p.cp}, e.g. data.seq_len={2 * p.cp * max(1, seq // (2 * p.cp))}")
    if p.sequence_parallel and p.tp > 1 and (seq // p.cp) % p.tp:
        raise ConfigError("data.seq_len", seq, f"sequence parallelism splits a cp rank's {seq // p.cp} tokens over "
                          f"tp={p.tp}", f"use a multiple of {2 * p.cp * p.tp}")
    if p.cp_comm == "a2a":
        for name, heads in (("model.n_head", m.n_head), ("model.n_kv_head", m.n_kv_head or m.n_head)):
            if (heads // p.tp) % p.cp:
                raise ConfigError(name, heads, f"parallelism.cp_comm=a2a gives each of cp={p.cp} ranks a share of "
                                  f"a tp rank's {heads // p.tp} heads (tp={p.tp}), which must divide evenly",
                                  f"use a head count divisible by tp x cp = {p.tp * p.cp}, or "
                                  "parallelism.cp_comm=allgather or ring (no head condition)")
    cf = m.moe.capacity_factor if m.arch == "qwen3_moe" else None
    if cf is not None and cf != float("inf"):
        raise ConfigError("model.moe.capacity_factor", cf, f"with parallelism.cp={p.cp}: capacity decides per whole "
                          "sequence over contiguous shards, and a cp rank's pieces are not contiguous (not built)",
                          "use model.moe.capacity_factor=null (dropless) with context parallelism")
    if m.dropout > 0:
        raise ConfigError("model.dropout", m.dropout, f"with parallelism.cp={p.cp} every cp rank would draw the same "
                          "dropout masks for its different tokens, which is not the single model's dropout",
                          "use model.dropout=0 with context parallelism")
    if p.pp > 1 and never_flushes(run.schedule):
        raise ConfigError(key, p.cp, f"schedule={run.schedule.name} is asynchronous and averages no gradients over "
                          "replicas; cp ranks are replicas (their gradients are averaged over dp x cp)",
                          "use a flushing schedule with parallelism.cp > 1")
