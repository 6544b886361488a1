"""Numbers the docs quote, re-run where they are cheap and traced where they are not.

Each quote is found by the words beside it (a marker: the regular expressions below, on the
doc's text with its line breaks folded), so a reworded sentence fails here by name rather
than going unchecked. Cheap commands run in process: every `python -m framework.simulate
--op-times ...` quoted in README.md and docs/, and Narayanan et al.'s Table 1 (the fit, the
rows up to 310B, the constant prediction beside them). A number that needs a long run
carries a dated, commit-named line ("measured 2026-11-28 at commit abc1234 by `command`"),
checked for here; its rows, where the doc lists them, must give its summary."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATED = r"(?:measured|printed) \d{4}-\d\d-\d\d at commit [0-9a-f]{7,40} by `"


def _text(name: str) -> str:
    return " ".join((ROOT / name).read_text().split())


def _quoted(name: str, marker: str) -> tuple:
    """The groups of `marker` in doc `name`, or a failure naming both."""
    found = re.search(marker, _text(name))
    assert found, f"{name} no longer quotes {marker!r}: update the doc's wording or this test's marker"
    return found.groups()


def _op_times(args: str, capsys) -> str:
    from framework.sim.optimes import command_line

    words = args.split()
    assert words[0] == "--op-times"
    capsys.readouterr()
    assert command_line(None, words[1], words[2:], False, None) == 0
    return capsys.readouterr().out


def test_every_quoted_op_times_command_runs_and_prints_the_bubbles_the_docs_quote(capsys):
    docs = ["README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))]
    commands = {(d, c) for d in docs for c in re.findall(r"python -m framework\.simulate (--op-times [^`]+?)(?:`| ```)",
                                                         _text(d))}
    assert len(commands) >= 2, commands  # cost_model.md's block and README's docs list
    printed = {c: _op_times(c, capsys) for c in {c for _, c in commands}}
    for text in printed.values():
        assert "schedule's own graph" in text and "executor's p2p batches" in text, text
    # cost_model.md: the executor's batches against the schedule's own graph, at its block's command
    block = _quoted("docs/cost_model.md", r"``` python -m framework\.simulate (--op-times [^`]+?) ```")[0]
    said = _quoted("docs/cost_model.md", r"executor's batches cost ZB-H1 a little more \(bubble (\d\.\d{3}) "
                                         r"against (\d\.\d{3}) at the 1\.5B row")
    got = [re.search(rf"{row}\s.*?\| bubble (\d\.\d{{3}})", printed[block]).group(1)
           for row in ("executor's p2p batches", "schedule's own graph")]
    assert list(said) == got, printed[block]


def _narayanan():
    spec = importlib.util.spec_from_file_location("narayanan2021", ROOT / "experiments/cluster_model/narayanan2021.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _readme_rows() -> dict:
    """experiments/cluster_model/README.md's Table 1: {size: (model error, constant error)}."""
    rows = re.findall(r"^\| ([\d.]+)B(?: \(fit\))? \|.*\| ([+-][\d.]+)% \|.*\| ([+-][\d.]+)% \|$",
                      (ROOT / "experiments/cluster_model/README.md").read_text(), re.M)
    return {float(size): (float(model) / 100, float(flat) / 100) for size, model, flat in rows}


def test_the_narayanan_table_its_fit_and_the_constant_beside_it_are_what_the_docs_say():
    """The fit and the rows up to 310B re-run (~3 s); the 529.6B and 1T rows take ~35 s of
    pipeline clock, so their errors come from the README's dated run, and the doc's median
    and max must be those of the eight rows."""
    import yaml

    from framework.sim.cost.hardware import Profile

    n = _narayanan()
    base = yaml.safe_load((ROOT / "conf/hardware/a100-dgx.yaml").read_text())
    fitted = n.fit(base)
    said = _quoted("docs/cost_model.md", r"fitted GEMM efficiency max ([\d.]+), half_dim (\d+), attention ([\d.]+)\)")
    assert [float(x) for x in said] == [fitted["gemm_efficiency"]["max"], fitted["gemm_efficiency"]["half_dim"],
                                        fitted["attention_efficiency"]]
    rows, prof = _readme_rows(), Profile.from_dict(fitted)
    predicted = [i for i in range(len(n.TABLE1)) if i not in n.FIT_ROWS]
    assert sorted(rows) == sorted(r[0] for r in n.TABLE1), rows
    for i in predicted:
        size, published = n.TABLE1[i][0], n.TABLE1[i][10]
        assert f"{rows[size][1]:+.1%}" == f"{n.CONSTANT / published - 1:+.1%}", size
        if size <= 310.1:
            tflops = n.predict(prof, *n.TABLE1[i][1:10])[0]
            assert f"{rows[size][0]:+.1%}" == f"{tflops / published - 1:+.1%}", size
    model = n.spread([rows[n.TABLE1[i][0]][0] for i in predicted])
    flat = n.spread([n.CONSTANT / n.TABLE1[i][10] - 1 for i in predicted])
    assert n.CONSTANT == 137.5
    doc_model = _quoted("docs/cost_model.md", r"the other eight rows of Table 1 median ([\d.]+) %, max ([\d.]+) %")
    doc_flat = _quoted("docs/cost_model.md", r"a constant prediction of 137\.5 TFLOP/s per GPU \(the two fitted "
                                             r"rows' mean\) scores median ([\d.]+) %, max ([\d.]+) %")
    assert model == "median |error| {}%, max {}%".format(*doc_model), model
    assert flat == "median |error| {}%, max {}%".format(*doc_flat), flat
    assert re.search(DATED + r"python experiments/cluster_model/narayanan2021\.py`", _text("docs/cost_model.md"))
    readme = _text("experiments/cluster_model/README.md")
    assert f"Table 1, rows not fitted: {model}; a constant 137.5 TFLOP/s/GPU (the fitted rows' mean): {flat}" in readme


def test_numbers_from_long_runs_carry_the_date_commit_and_command():
    """The README's console example is a 30-60 s training run: it says when, at which commit
    and by what it was printed."""
    assert re.search(DATED + r"\.venv/bin/python run\.py`", _text("README.md"))
    assert re.search(DATED + r"python -m framework\.sim\.bench", _text("docs/cost_model.md"))
