"""A sweep with repeats (`sweep.repeats=N`, framework/launch/repeats.py): per configuration
a median with an interval, for each configuration against the next one in the ranking
whether they can be told apart, and whether the sweep has a winner.

A configuration is a job's overrides without `sweep.repeat=`, named by what sets it apart
from the sweep's other configurations (the overrides every configuration shares, such as
`sweep.repeats=3`, are left out of its name). Its samples are the tokens/s of each repeat's
measured steps (metrics.jsonl rows after the warm-up: summary.json's `measured_steps` last
rows, else the rows after config.yaml's `metrics.skip_first`; a repeat whose warm-up cannot
be told apart gives no samples).

The interval counts run-to-run spread: a 95 % percentile bootstrap that is hierarchical
(`RESAMPLES` resamples, seeded: the same report every time): each resample draws the
repeats with replacement, then the steps within each drawn repeat, and takes the median of
what it drew. A configuration whose repeats disagree (1000 / 1310 / 1320 tok/s) gets an
interval as wide as that disagreement, so it is not told apart from one at 1290 / 1300 /
1300. With fewer than `MIN_REPEATS` repeats a resample of the repeats has too few
combinations to stand for run-to-run spread: the interval then resamples the steps within
each repeat only, the report says so, and no pair involving it is told apart. For two
configurations ranked next to each other the speed-up is median(A) / median(B) - 1 with
the same bootstrap of both; when its interval holds 0 they are "not distinguishable".

The winner (`verdict`): the top configuration, named only when it is told apart from the
second and no repeat was measured with noise (summary.json's `noisy`); else the ranking
stands and the line says why no winner is named.
"""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

import yaml

RESAMPLES = 1000
LEVEL = 0.95
MIN_REPEATS = 3  # below this, resampling the repeats cannot stand for run-to-run spread


def configuration(overrides: str) -> str:
    return " ".join(o for o in (overrides or "").split() if not o.startswith("sweep.repeat=")) or "defaults"


def names(configurations: list[str]) -> dict[str, str]:
    """Each configuration's name: its overrides less those every configuration shares."""
    tokens = {c: c.split() for c in configurations}
    if len(tokens) < 2:
        return {c: c for c in configurations}
    common = set.intersection(*(set(t) for t in tokens.values()))
    return {c: " ".join(o for o in t if o not in common) or "defaults" for c, t in tokens.items()}


def samples(job: Path) -> list[float]:
    """tokens/s of the job's measured steps, never a warm-up step ([] when its files cannot
    be read, or when which steps are warm-up cannot be told)."""
    try:
        measured = json.loads((job / "summary.json").read_text()).get("measured_steps")
        rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []
    if isinstance(measured, int) and not isinstance(measured, bool) and measured <= len(rows):
        kept = rows[len(rows) - measured:] if measured > 0 else []  # rows[-0:] would keep them all
    else:  # no measured_steps (an older summary), or more than the rows (a cut file): the config's warm-up
        skip = _skip_first(job)
        kept = [] if skip is None else [r for r in rows if isinstance(r.get("step"), int) and r["step"] > skip]
    return [r["tokens_per_s"] for r in kept if isinstance(r.get("tokens_per_s"), (int, float))]


def _skip_first(job: Path):
    try:
        skip = ((yaml.safe_load((job / "config.yaml").read_text()) or {}).get("metrics") or {}).get("skip_first")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return skip if isinstance(skip, int) and not isinstance(skip, bool) else None


def _resample(rng: random.Random, repeats: list[list[float]]) -> float:
    """One bootstrap median: the repeats drawn with replacement (when there are enough of
    them to stand for run-to-run spread), then the steps within each drawn repeat."""
    drawn = rng.choices(repeats, k=len(repeats)) if len(repeats) >= MIN_REPEATS else repeats
    return statistics.median([x for rep in drawn for x in rng.choices(rep, k=len(rep))])


def _interval(values: list[float]) -> tuple[float, float]:
    values = sorted(values)
    lo, hi = (1 - LEVEL) / 2, 1 - (1 - LEVEL) / 2
    return values[int(lo * (len(values) - 1))], values[int(round(hi * (len(values) - 1)))]


@dataclass
class Configuration:
    name: str  # what sets it apart from the sweep's other configurations
    median: float  # tokens/s over every measured step of every repeat
    low: float  # the median's interval (LEVEL)
    high: float
    repeats: list[float]  # each repeat's own median
    noisy: int = 0  # how many of its repeats were flagged noisy

    @property
    def across_runs(self) -> bool:
        """Whether the interval counts run-to-run spread (MIN_REPEATS or more repeats)."""
        return len(self.repeats) >= MIN_REPEATS


@dataclass
class Pair:
    faster: str  # the better-ranked configuration
    slower: str
    gain: float  # median(faster) / median(slower) - 1
    low: float  # its interval
    high: float
    across_runs: bool = True  # both intervals count run-to-run spread

    @property
    def distinguishable(self) -> bool:
        return self.across_runs and not self.low <= 0 <= self.high


def summarise(sweep: Path, done: list[dict]) -> tuple[list[Configuration], list[Pair]]:
    """The configurations, best first, and each against the next; ([], []) when none ran
    more than once."""
    by: dict[str, list[list[float]]] = {}
    noisy: dict[str, int] = {}
    for r in done:
        got = samples(sweep / r["job"])
        if got:
            c = configuration(r.get("overrides"))
            by.setdefault(c, []).append(got)
            noisy[c] = noisy.get(c, 0) + bool(r.get("noisy"))
    if not any(len(reps) > 1 for reps in by.values()):
        return [], []
    rng = random.Random(0)
    boot = {c: [_resample(rng, reps) for _ in range(RESAMPLES)] for c, reps in by.items()}
    median = {c: statistics.median([x for rep in reps for x in rep]) for c, reps in by.items()}
    ranked = sorted(by, key=lambda c: -median[c])
    name = names(ranked)
    configs = [Configuration(name[c], median[c], *_interval(boot[c]), [statistics.median(rep) for rep in by[c]],
                             noisy[c]) for c in ranked]
    pairs = [Pair(name[a], name[b], median[a] / median[b] - 1,
                  *_interval([x / y - 1 for x, y in zip(boot[a], boot[b])]),
                  min(len(by[a]), len(by[b])) >= MIN_REPEATS)
             for a, b in zip(ranked, ranked[1:])]
    return configs, pairs


def verdict(configs: list[Configuration], pairs: list[Pair]) -> str:
    """The winner line: the top configuration when it is told apart from the second and no
    repeat was noisy; else why none is named (the ranking above stands)."""
    why = []
    flagged = sum(c.noisy for c in configs)
    if flagged:
        why.append(f"{flagged} of {sum(len(c.repeats) for c in configs)} repeats were measured with noise "
                   "(the warnings above)")
    if pairs and not pairs[0].across_runs:
        why.append(f"fewer than {MIN_REPEATS} repeats: the intervals cannot include run-to-run spread")
    elif pairs and not pairs[0].distinguishable:
        why.append(f"the top two, {pairs[0].faster} and {pairs[0].slower}, are not distinguishable")
    if why:
        return "no winner named: " + "; ".join(why)
    top = configs[0]
    return f"best configuration: {top.name} ({top.median:,.0f} tokens/s [{top.low:,.0f} - {top.high:,.0f}])"


def lines(sweep: Path, done: list[dict]) -> list[str]:
    """The report's lines about repeats; [] when no configuration ran more than once."""
    configs, pairs = summarise(sweep, done)
    if not configs:
        return []
    spread = "every repeat's steps, repeats and steps resampled" if all(c.across_runs for c in configs) else \
        f"every repeat's steps; WARNING: with fewer than {MIN_REPEATS} repeats the interval resamples steps " \
        "within each repeat only and cannot include run-to-run spread"
    out = [f"repeats: tokens/s, median [{LEVEL:.0%} interval] over {spread} (framework/report/repeats.py):"]
    for i, c in enumerate(configs, 1):
        each = " / ".join(f"{m:,.0f}" for m in c.repeats)
        out.append(f"  {i}. {c.name}: {c.median:,.0f} [{c.low:,.0f} - {c.high:,.0f}] ({len(c.repeats)} repeats: {each})")
    for p in pairs:
        if p.distinguishable:
            out.append(f"  {p.faster} is {p.gain:.1%} faster than {p.slower} (interval {p.low:+.1%} to {p.high:+.1%})")
        elif not p.across_runs:
            out.append(f"  {p.faster} and {p.slower} are not told apart: {p.gain:+.1%} (within-run interval "
                       f"{p.low:+.1%} to {p.high:+.1%}; fewer than {MIN_REPEATS} repeats)")
        else:
            out.append(f"  {p.faster} and {p.slower} are not distinguishable ({p.gain:+.1%}, interval {p.low:+.1%} "
                       f"to {p.high:+.1%})")
    return out + ([verdict(configs, pairs)] if len(configs) > 1 else [])  # one configuration: nothing to rank
