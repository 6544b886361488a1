"""The house rules of framework/ (docs/code-map.md): packages by concern, nothing loose at the
top but the policies and thin entry points, no standard-library names, no import cycle,
files over ~300 lines say why."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMEWORK = os.path.join(ROOT, "framework")
# The cross-cutting policies: rank layout, precision, device, and how a command tells a bad argument.
POLICIES = {"__init__.py", "topology.py", "precision.py", "device.py", "commands.py", "files.py", "timestamps.py"}
ENTRY_POINTS = {"simulate.py", "worker.py"}  # `python -m framework.X`, a few lines each (and every package's __main__.py)


def modules() -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(FRAMEWORK):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def import_graph(mods: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the framework modules it imports, anywhere in the file (functions included)."""
    edges = {m: set() for m in mods}
    for m, path in mods.items():
        pkg = m if path.endswith("__init__.py") else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(open(path).read())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for n in names:
                while n and n not in mods:
                    n = n.rsplit(".", 1)[0] if "." in n else ""
                if n and n != m and not m.startswith(n + "."):
                    edges[m].add(n)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on.discard(w); comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_framework():
    assert cycles(import_graph(modules())) == []


def test_nothing_loose_at_the_top_but_the_policies_and_thin_entry_points():
    top = {f for f in os.listdir(FRAMEWORK) if f.endswith(".py")}
    assert top - POLICIES - ENTRY_POINTS == set()
    mains = {os.path.join(d, "__main__.py") for d in os.listdir(FRAMEWORK) if os.path.isfile(os.path.join(FRAMEWORK, d, "__main__.py"))}
    assert {"schedules/__main__.py", "report/__main__.py"} <= mains
    for f in ENTRY_POINTS | mains:
        assert len(open(os.path.join(FRAMEWORK, f)).read().splitlines()) <= 12, f


def test_no_module_shares_a_standard_library_name():
    clashes = sorted(p for m, p in modules().items() if m.rsplit(".", 1)[-1] in sys.stdlib_module_names)
    assert clashes == []


def test_files_past_330_lines_say_why_in_their_docstring():
    unexplained = []
    for m, path in modules().items():
        text = open(path).read()
        if len(text.splitlines()) > 330 and "past ~300 lines" not in (ast.get_docstring(ast.parse(text)) or ""):
            unexplained.append(path)
    assert unexplained == []


def test_every_module_imports_first():
    """Import each module first into a table without any framework module: a package
    `__init__` that imports its siblings can close a cycle that only this order shows
    (the ranks import framework.train.signals before anything of launch/)."""
    names = sorted(m for m in modules() if not m.endswith("__main__"))
    code = (
        "import sys, importlib\n"
        f"bad = []\nfor name in {names!r}:\n"
        "    for k in [k for k in sys.modules if k == 'framework' or k.startswith('framework.')]:\n"
        "        del sys.modules[k]\n"
        "    try:\n        importlib.import_module(name)\n"
        "    except Exception as e:\n        bad.append(f'{name}: {e!r}')\n"
        "print('\\n'.join(bad)); sys.exit(1 if bad else 0)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_serial_test_named_in_conftest_exists():
    """tests/conftest.py's SERIAL names the tests that run alone; a renamed one would silently
    run beside another worker. Each must name a file and a test function defined in it."""
    from .conftest import GROUPS, SERIAL, SLOWEST_FIRST

    for prefix in SERIAL:
        path, _, rest = prefix.partition("::")
        text = open(os.path.join(ROOT, path)).read()
        name = rest.split("[")[0]
        assert not name or re.search(rf"^def {re.escape(name)}\w*\(", text, re.M), prefix
    assert all(os.path.isfile(os.path.join(ROOT, "tests", f)) for f in (*GROUPS, *SLOWEST_FIRST))
