"""Every key of the typed config, fuzzed from the schema: no hand list of keys or cases.

For each leaf of framework.config.RunConfig the fuzz generates bad values from the key's type
(a word for a number, a fraction for an integer, nan, inf, negative, zero, huge, empty, a
path that does not exist, a file and a directory of garbage) and from its Rule (just past
each bound), and runs, in this process and with no rank, what `python run.py` runs before
launch: the command-line check, the composition, `framework.validate.configure` and
`run_job` with `launcher=external` (validation, resume, data preparation, the meta model,
the plan's checks; it stops where ranks would start). Each case must end in one of two ways:
accepted, or a one-line ConfigError that names the key (a value the key's rule allows may be
refused by a cross-key check naming another key). Never another exception, and within a
bounded time and peak-memory growth. A key added to the schema is fuzzed without anyone
writing a case for it; `test_every_key_states_its_rule` makes the new key state its range.
"""

from __future__ import annotations

import math
import resource
import time
from dataclasses import MISSING

import pytest

from framework.config import ConfigError, rule_of
from framework.validate.ranges import leaves
from .prelaunch import prelaunch

# No rank, no W&B, no CPU peak probe; synthetic tokens need no files.
BASE = ["data=synthetic", "logger=none", "launcher=external", "metrics.peak_tflops=1", "parallelism=pp2",
        "trainer.steps=4"]
SECONDS_PER_CASE = 30.0  # generous: the whole path takes ~0.1 s here; a case that allocates or loops by a number
RSS_GROWTH_BYTES = 1 << 30  # in the value would pass both


def _optional(f) -> bool:
    return "Optional" in str(f.type) or f.default is None


def bad_values(t, rule, f, garbage_file: str, garbage_dir: str) -> list[tuple[str, bool]]:
    """(value as typed on the command line, whether the value is bad for this key whatever
    the other keys say: then the error must name the key)."""
    out: list[tuple[str, bool]] = []
    if not _optional(f):
        out.append(("null", True))
    if t is bool:
        return out + [("maybe", True), ("2", True)]
    if t in (int, float):
        out += [("abc", True), ("nan", True)]
        out += [("inf", not rule.inf)] if t is float else [("1.5", True)]
        for v in (-1, 0, 1, 10**30 if t is int else 1e308):
            out.append((repr(v), _outside(v, rule)))
        for op in ("ge", "gt", "le", "lt"):  # just past each numeric bound
            b = getattr(rule, op)
            if isinstance(b, (int, float)) and not isinstance(b, bool):
                step = 1 if t is int else max(abs(b) * 1e-6, 1e-9)
                v = {"ge": b - step, "gt": b, "le": b + step, "lt": b}[op]
                out.append((repr(v), True))
        return out
    if t is str:
        if rule.choices:
            out.append(("nosuch", True))
        out += [("''", rule.nonempty or bool(rule.choices)), ("/no/such/dir/x", bool(rule.choices)),
                (garbage_file, bool(rule.choices)), (garbage_dir, bool(rule.choices))]
        return out
    # dict, list, Any: free-form, checked by the object they configure
    return out + [("abc", False), ("[]", False), ("{}", False), ("{a: nan}", False), ("[1, -1]", False),
                  (garbage_file, False)]


def _outside(v: float, rule) -> bool:
    """Whether a number breaks one of the rule's numeric bounds (a bound from another key is
    not judged here)."""
    if isinstance(v, float) and math.isinf(v):
        return not rule.inf
    for op, ok in (("ge", v >= (rule.ge if isinstance(rule.ge, (int, float)) else -math.inf)),
                   ("gt", v > (rule.gt if isinstance(rule.gt, (int, float)) else -math.inf)),
                   ("le", v <= (rule.le if isinstance(rule.le, (int, float)) else math.inf)),
                   ("lt", v < (rule.lt if isinstance(rule.lt, (int, float)) else math.inf))):
        if getattr(rule, op) is not None and not ok:
            return True
    return False


@pytest.fixture(scope="module")
def garbage(tmp_path_factory):
    d = tmp_path_factory.mktemp("garbage")
    f = d / "garbage.bin"
    f.write_bytes(bytes(range(256)) * 64 + b"\xff\xfe\x00 not json, not csv, not yaml {[")
    (d / "dir").mkdir()
    (d / "dir" / "meta.json").write_bytes(b"\x00\x01{not json")
    (d / "dir" / "calibration.json").write_text("[1, 2")
    (d / "dir" / "COMPLETE").write_text("")
    return str(f), str(d / "dir")


def _cases():
    for path, _, f, t in leaves():
        yield path, f, t


def test_every_key_states_its_rule():
    """A new key cannot slip past: a number states a range, a string its choices (or why it
    has none), a free-form value who checks it."""
    missing = []
    for path, f, t in _cases():
        rule = rule_of(f)
        if t is bool:
            continue
        if t in (int, float):
            ok = any(getattr(rule, op) is not None for op in ("ge", "gt", "le", "lt")) or rule.free
        elif t is str:
            ok = rule.choices or rule.free
        else:
            ok = rule.free
        if not ok:
            missing.append(path)
    assert missing == [], f"keys without a rule in framework/config/: {missing}"


def test_every_key_of_the_schema_is_fuzzed(garbage, tmp_path):
    """Every leaf key, every generated value: accepted, or a one-line ConfigError naming the key."""
    failures, count, slowest = [], 0, (0.0, "")
    for path, f, t in _cases():
        rule = rule_of(f)
        for value, bad in bad_values(t, rule, f, *garbage):
            count += 1
            base = BASE + list(rule.base)
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            t0 = time.perf_counter()
            try:
                prelaunch(base, f"{path}={value}", str(tmp_path / f"job{count}"))
                if bad:
                    failures.append(f"{path}={value}: accepted")
            except ConfigError as e:
                msg = str(e)
                if "\n" in msg:
                    failures.append(f"{path}={value}: a message of {msg.count(chr(10)) + 1} lines: {msg!r}")
                if bad and e.key != path:
                    failures.append(f"{path}={value}: the error names {e.key}: {msg}")
            except Exception as e:  # noqa: BLE001 - the defect this test exists to find
                failures.append(f"{path}={value}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            dt = time.perf_counter() - t0
            slowest = max(slowest, (dt, f"{path}={value}"))
            grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss
            if dt > SECONDS_PER_CASE or grew > RSS_GROWTH_BYTES:
                failures.append(f"{path}={value}: {dt:.1f} s, peak RSS +{grew / 2**20:.0f} MiB")
    print(f"{count} cases; slowest {slowest[0]:.2f} s ({slowest[1]})")
    assert failures == [], "\n".join(failures)
    assert count > 500


def test_defaults_are_valid():
    """Each field's own default satisfies its own rule where no other key bounds it (a rule
    stricter than the default would reject every run that leaves the key alone)."""
    for path, f, t in _cases():
        default = f.default if f.default is not MISSING else None
        rule = rule_of(f)
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            assert not _outside(default, rule), path
        if isinstance(default, str) and rule.choices:
            assert default in rule.choices, path
