"""Nothing outside the schedule registry names a schedule: every string literal in
framework/ (the registry's modules excepted) and run.py is checked against the registered
names, so adding a schedule touches its own module and nothing else in the code."""

import io
import tokenize
from pathlib import Path

from framework.schedules import names

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = ROOT / "framework" / "schedules"
# the schedule model beside the registry in that package: not the registry, so checked too
MODEL = {"messages.py", "clock.py", "matching.py", "check.py", "p2p.py", "tiling.py", "__main__.py"}


def _named(path: Path) -> list[tuple[int, str]]:
    """String literals of a file that are a schedule name, or hold `=<name>` / `'<name>'`."""
    quoted = {q + n + q for n in names() for q in ('"', "'")}
    return [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
            if tok.type == tokenize.STRING and (tok.string in quoted or any(
                f"={n}" in tok.string or repr(n) in tok.string for n in names()))]


def test_no_schedule_name_outside_the_registry():
    files = [p for p in (ROOT / "framework").rglob("*.py") if REGISTRY not in p.parents or p.name in MODEL] + [ROOT / "run.py"]
    found = [f"{p.relative_to(ROOT)}:{line}: {text}" for p in files for line, text in _named(p)]
    assert len(files) > 40 and not found, found


def test_the_check_sees_a_name_where_one_is_written(tmp_path):
    (tmp_path / "x.py").write_text('SCHEDULE = "zbv"\nuse = f"schedule=dualpipev"\nok = "flush=True"\n')
    assert [t for _, t in _named(tmp_path / "x.py")] == ['"zbv"', 'f"schedule=dualpipev"']
