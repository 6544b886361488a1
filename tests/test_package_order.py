"""The packages of framework/ depend one way (docs/code-map.md, "Package order"): a module
imports only from its own package and the packages below it. The order is read from the
code map, so the page and the rule cannot drift apart. No import points up (issue 49 moved
the last 17 down: the schedule model, the layers' collectives, the run's prediction), so any
new one fails with its file and line; and, whatever the page says, no two packages import
each other."""

from __future__ import annotations

import ast
import os
import re

import pytest

from .test_layout import ROOT, modules

def package_order() -> list[str]:
    text = open(os.path.join(ROOT, "docs", "code-map.md")).read()
    line = re.search(r"^Package order, lowest first: (.+)$", text, re.M)
    assert line, "docs/code-map.md has no 'Package order, lowest first: a -> b -> ...' line"
    return [p.strip(" `.") for p in line.group(1).split("->")]


def package_of(module: str) -> str:
    """framework.parallel.zero -> parallel; framework.config -> config; framework -> framework."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imports(mods: dict[str, str]):
    """(file, line, imported framework module) of every import statement, functions included."""
    for m, path in sorted(mods.items()):
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "framework" else [node.module]
            else:
                continue
            for n in names:
                if n.split(".")[0] == "framework" and "." in n:
                    while n not in mods and "." in n:
                        n = n.rsplit(".", 1)[0]
                    yield rel, m, node.lineno, n


def upward(order: list[str]) -> list[tuple[str, int, str, str, str]]:
    rank = {p: i for i, p in enumerate(order)}
    out = []
    for rel, m, line, target in imports(modules()):
        a, b = package_of(m), package_of(target)
        if a != b and rank[b] > rank[a]:
            out.append((rel, line, target, a, b))
    return out


def test_every_package_has_its_place_in_the_order():
    order = package_order()
    packages = {package_of(m) for m in modules()}
    assert not packages - set(order), f"docs/code-map.md's package order lacks {sorted(packages - set(order))}"
    assert len(order) == len(set(order))


def test_no_import_goes_up_the_package_order():
    found = [f"{rel}:{line} imports {target} ({a} below {b} in docs/code-map.md's order)"
             for rel, line, target, a, b in upward(package_order())]
    assert not found, "imports up the package order (import downward, or move what both need lower):\n" + "\n".join(found)


def test_no_two_packages_import_each_other():
    edges: dict[tuple[str, str], str] = {}
    for rel, m, line, target in imports(modules()):
        a, b = package_of(m), package_of(target)
        if a != b:
            edges.setdefault((a, b), f"{rel}:{line}")
    pairs = sorted(f"{a} <-> {b} ({edges[a, b]}, {edges[b, a]})" for a, b in edges if (b, a) in edges and a < b)
    assert not pairs, "packages that import each other:\n" + "\n".join(pairs)


def test_the_order_check_finds_an_upward_import(tmp_path, monkeypatch):
    """The checker itself: config importing the trainer is upward in any sane order."""
    assert package_of("framework.parallel.pipeline.executor") == "parallel" and package_of("framework.config") == "config"
    order = package_order()
    assert order.index("config") < order.index("train")
    fake = dict(modules())
    path = tmp_path / "config.py"
    path.write_text("from framework.train.trainer import build_runner\n")
    fake["framework.config"] = str(path)
    monkeypatch.setattr("tests.test_package_order.modules", lambda: fake)
    rel = os.path.relpath(str(path), ROOT).replace(os.sep, "/")
    assert (rel, 1, "framework.train.trainer", "config", "train") in upward(order)
    with pytest.raises(AssertionError, match="config <-> train"):  # train imports config: a pair
        test_no_two_packages_import_each_other()
