"""A sweep with repeats (`sweep.repeats=N`, framework/launch/repeats.py): per configuration
a median with an interval, and for each configuration against the next one in the ranking
whether they can be told apart.

A configuration is a job's overrides without `sweep.repeat=`. Its samples are the tokens/s
of every measured step (metrics.jsonl rows after the warm-up: summary.json's
`measured_steps` last rows) of all its completed repeats. The median is over those samples;
its interval is a 95 % percentile bootstrap (`RESAMPLES` resamples, seeded: the same report
every time) that resamples the steps within each repeat, so a repeat with more steps does
not stand for the others. For two configurations ranked next to each other the speed-up is
median(A) / median(B) - 1 with the same bootstrap of both; when its interval holds 0 they
are "not distinguishable". Steps within a run are not independent (a slow period spans
several), so the interval is narrower than the truth when a run's steps drift together:
the repeats, interleaved, are what makes such drift show as spread.
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

RESAMPLES = 1000
LEVEL = 0.95


def configuration(overrides: str) -> str:
    return " ".join(o for o in (overrides or "").split() if not o.startswith("sweep.repeat=")) or "defaults"


def samples(job: Path) -> list[float]:
    """tokens/s of the job's measured steps ([] when its files cannot be read)."""
    try:
        measured = json.loads((job / "summary.json").read_text()).get("measured_steps") or 0
        rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []
    return [r["tokens_per_s"] for r in rows[-measured:] if isinstance(r.get("tokens_per_s"), (int, float))]


def _resample(rng: random.Random, repeats: list[list[float]]) -> float:
    return statistics.median([x for rep in repeats for x in rng.choices(rep, k=len(rep))])


def _interval(values: list[float]) -> tuple[float, float]:
    values = sorted(values)
    lo, hi = (1 - LEVEL) / 2, 1 - (1 - LEVEL) / 2
    return values[int(lo * (len(values) - 1))], values[int(round(hi * (len(values) - 1)))]


def lines(sweep: Path, done: list[dict]) -> list[str]:
    """The report's lines about repeats; [] when no configuration ran more than once."""
    by: dict[str, list[list[float]]] = {}
    for r in done:
        got = samples(sweep / r["job"])
        if got:
            by.setdefault(configuration(r.get("overrides")), []).append(got)
    if not any(len(reps) > 1 for reps in by.values()):
        return []
    rng = random.Random(0)
    boot = {c: [_resample(rng, reps) for _ in range(RESAMPLES)] for c, reps in by.items()}
    median = {c: statistics.median([x for rep in reps for x in rep]) for c, reps in by.items()}
    ranked = sorted(by, key=lambda c: -median[c])
    out = [f"repeats: tokens/s, median [{LEVEL:.0%} interval] over the measured steps of every repeat "
           "(repeats interleaved; framework/report/repeats.py):"]
    for i, c in enumerate(ranked, 1):
        lo, hi = _interval(boot[c])
        each = " / ".join(f"{statistics.median(rep):,.0f}" for rep in by[c])
        out.append(f"  {i}. {c}: {median[c]:,.0f} [{lo:,.0f} - {hi:,.0f}] ({len(by[c])} repeats: {each})")
    for a, b in zip(ranked, ranked[1:]):
        gain = median[a] / median[b] - 1
        lo, hi = _interval([x / y - 1 for x, y in zip(boot[a], boot[b])])
        if lo <= 0 <= hi:
            out.append(f"  {a} and {b} are not distinguishable ({gain:+.1%}, interval {lo:+.1%} to {hi:+.1%})")
        else:
            out.append(f"  {a} is {gain:.1%} faster than {b} (interval {lo:+.1%} to {hi:+.1%})")
    return out
