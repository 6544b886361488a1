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
from dataclasses import dataclass
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


@dataclass
class Configuration:
    name: str  # the overrides without sweep.repeat=
    median: float  # tokens/s over every measured step of every repeat
    low: float  # the median's interval (LEVEL)
    high: float
    repeats: list[float]  # each repeat's own median


@dataclass
class Pair:
    faster: str  # the better-ranked configuration
    slower: str
    gain: float  # median(faster) / median(slower) - 1
    low: float  # its interval
    high: float

    @property
    def distinguishable(self) -> bool:
        return not self.low <= 0 <= self.high


def summarise(sweep: Path, done: list[dict]) -> tuple[list[Configuration], list[Pair]]:
    """The configurations, best first, and each against the next; ([], []) when none ran
    more than once."""
    by: dict[str, list[list[float]]] = {}
    for r in done:
        got = samples(sweep / r["job"])
        if got:
            by.setdefault(configuration(r.get("overrides")), []).append(got)
    if not any(len(reps) > 1 for reps in by.values()):
        return [], []
    rng = random.Random(0)
    boot = {c: [_resample(rng, reps) for _ in range(RESAMPLES)] for c, reps in by.items()}
    median = {c: statistics.median([x for rep in reps for x in rep]) for c, reps in by.items()}
    ranked = sorted(by, key=lambda c: -median[c])
    configs = [Configuration(c, median[c], *_interval(boot[c]), [statistics.median(rep) for rep in by[c]])
               for c in ranked]
    pairs = [Pair(a, b, median[a] / median[b] - 1, *_interval([x / y - 1 for x, y in zip(boot[a], boot[b])]))
             for a, b in zip(ranked, ranked[1:])]
    return configs, pairs


def lines(sweep: Path, done: list[dict]) -> list[str]:
    """The report's lines about repeats; [] when no configuration ran more than once."""
    configs, pairs = summarise(sweep, done)
    if not configs:
        return []
    out = [f"repeats: tokens/s, median [{LEVEL:.0%} interval] over the measured steps of every repeat "
           "(repeats interleaved; framework/report/repeats.py):"]
    for i, c in enumerate(configs, 1):
        each = " / ".join(f"{m:,.0f}" for m in c.repeats)
        out.append(f"  {i}. {c.name}: {c.median:,.0f} [{c.low:,.0f} - {c.high:,.0f}] ({len(c.repeats)} repeats: {each})")
    for p in pairs:
        if p.distinguishable:
            out.append(f"  {p.faster} is {p.gain:.1%} faster than {p.slower} (interval {p.low:+.1%} to {p.high:+.1%})")
        else:
            out.append(f"  {p.faster} and {p.slower} are not distinguishable ({p.gain:+.1%}, interval {p.low:+.1%} "
                       f"to {p.high:+.1%})")
    return out
