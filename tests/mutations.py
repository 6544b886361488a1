"""The mutation check: each named bug, planted in a copy of the repository, must fail a test.

Run on demand, not in CI's time (each mutation runs its tests, a few minutes in all per bug):

    .venv/bin/python tests/mutations.py              # every mutation; the table to stdout
    .venv/bin/python tests/mutations.py --list       # names only
    .venv/bin/python tests/mutations.py --only edp-reduction-noop rng-restore-dropped
    .venv/bin/python tests/mutations.py --baseline --out experiments/mutations/results.md

Each mutation is one exact text replacement in one source file (the old text must occur
exactly once, so a refactor that moves the code makes the check say so instead of silently
testing nothing) and the tests that claim to catch it. The tree is copied (the files git
tracks plus untracked ones it does not ignore, so an uncommitted working tree is checked as
it stands), the replacement applied, and pytest run with that copy first on PYTHONPATH
(worker processes inherit it) and `-x`: the first failure is enough. A mutation is
**caught** when pytest reports failures (exit 1), **survived** when its tests pass (exit 0),
and anything else (a collection error, a timeout) is reported as such, never as caught.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.mutation_list import MUTATIONS, Mutation  # noqa: E402  (the list is data, beside this runner)


def _copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    shared = ROOT.parent / "shared"
    if shared.exists():  # the layout CI clones into: ../shared beside the repository
        os.symlink(shared, dest.parent / "shared")


def apply(mutation: Mutation, tree: Path) -> None:
    path = tree / mutation.file
    text = path.read_text()
    count = text.count(mutation.old)
    if count != 1:
        raise SystemExit(f"mutation {mutation.name}: its old text occurs {count} times in {mutation.file} "
                         "(it must occur exactly once: update tests/mutation_list.py)")
    path.write_text(text.replace(mutation.old, mutation.new))


def run_one(mutation: Mutation | None, timeout: float, tests: tuple[str, ...] = ()) -> tuple[str, float, str]:
    """(verdict, seconds, the first failing test or the reason); no mutation: the baseline."""
    with tempfile.TemporaryDirectory(prefix=f"mutant_{mutation.name if mutation else 'none'}_") as tmp:
        tree = Path(tmp) / "main"
        tree.mkdir()
        _copy_tree(tree)
        if mutation is not None:
            apply(mutation, tree)
        env = dict(os.environ, PYTHONPATH=str(tree), CI="true")
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *(mutation.tests if mutation
                                                                                        else tests)]
        t0 = time.time()
        try:
            out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "timeout", time.time() - t0, f"over {timeout:.0f} s"
        took = time.time() - t0
        failed = [ln.split(" ")[1] for ln in out.stdout.splitlines() if ln.startswith("FAILED ")]
        if out.returncode == 1 and failed:
            return "caught", took, failed[0].split(" - ")[0]
        if out.returncode == 0:
            return "SURVIVED", took, "every test passed"
        return f"error (pytest exit {out.returncode})", took, (out.stdout + out.stderr).strip().splitlines()[-1][:200]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="run these mutations only")
    ap.add_argument("--list", action="store_true", help="print the mutations' names and bugs")
    ap.add_argument("--out", help="also write the markdown table here")
    ap.add_argument("--baseline", action="store_true",
                    help="first run the chosen mutations' tests on the unmutated tree: they must pass")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per mutation")
    args = ap.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTATIONS}
    if unknown:
        raise SystemExit(f"--only: no mutation named {sorted(unknown)}; --list shows them")
    if args.list:
        for m in chosen:
            print(f"{m.name:32s} {m.bug}")
        return 0
    for m in chosen:  # every replacement checked before anything runs
        if (ROOT / m.file).read_text().count(m.old) != 1:
            raise SystemExit(f"mutation {m.name}: its old text does not occur exactly once in {m.file}")
    commit = subprocess.run(["git", "log", "-1", "--format=%h %cs"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    lines = [f"Mutation check at commit {commit}{' (with uncommitted changes)' if dirty else ''}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, `python tests/mutations.py`:", "",
             "| mutation | the bug | planted in | verdict | first failing test | s |", "|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    if args.baseline:  # a test that fails anyway proves nothing about the bug
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        verdict, took, detail = run_one(None, args.timeout * len(chosen), tests)
        base = "pass" if verdict == "SURVIVED" else f"{verdict}: {detail}"
        lines.append(f"| (none: the baseline) | - | - | {base} | {len(tests)} test files / ids | {took:.0f} |")
        print(lines[-1], flush=True)
        if base != "pass":
            return 2
    survived = 0
    for m in chosen:
        verdict, took, detail = run_one(m, args.timeout)
        survived += verdict != "caught"
        row = f"| {m.name} | {m.bug} | `{m.file}` | {verdict} | `{detail}` | {took:.0f} |"
        lines.append(row)
        print(row, flush=True)
    summary = f"{len(chosen) - survived} of {len(chosen)} mutations caught."
    lines += ["", summary]
    print("\n" + summary)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
