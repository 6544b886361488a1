"""The mutation check's list (tests/mutation_list.py) stays planted in today's code: every
mutation's text occurs exactly once in its file, and every test it names exists, so a
refactor cannot silently turn a mutation into one that changes nothing."""

import os

import pytest

from .mutation_list import MUTATIONS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("m", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_each_mutation_still_applies(m):
    text = open(os.path.join(ROOT, m.file)).read()
    assert text.count(m.old) == 1, f"{m.name}: its text occurs {text.count(m.old)} times in {m.file}"
    assert m.new != m.old
    for node in m.tests:
        path, _, name = node.partition("::")
        assert os.path.exists(os.path.join(ROOT, path)), node
        if name:
            assert f"def {name.split('[')[0]}(" in open(os.path.join(ROOT, path)).read(), node
