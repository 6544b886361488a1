"""report.html (framework/report/dashboard.py) rendered by a real browser: Debian's chromium,
headless, prints the DOM after plotly has drawn the page. Every figure must be drawn, every
job must be in the legends and the table with its numbers, and the page must need no network."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess

import pytest

from framework.report.dashboard import byte_unit, common_overrides, fmt_bytes, fmt_number, fmt_percent, label, write_dashboard
from framework.report.compare import collect, headline
from framework.report.dashboard_checks import read_checks
from framework.report.compare import main as report_main

from .test_report import fake_sweep

CHROMIUM = "chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--window-size=1280,1000",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def test_units_read_like_a_person_writes_them():
    assert byte_unit(3 * 2**30) == ("GiB", 2**30) and byte_unit(5 * 2**20) == ("MiB", 2**20)
    assert byte_unit(100) == ("B", 1) and byte_unit(0) == ("B", 1)
    assert [fmt_bytes(v) for v in (1536, 5 * 2**20, 2.5 * 2**30, 12)] == ["1.5 KiB", "5.0 MiB", "2.5 GiB", "12 B"]
    assert fmt_percent(0.1234) == "12.3%" and fmt_number(20456.7) == "20,457" and fmt_number(5.5472) == "5.547"
    assert fmt_bytes(None) == fmt_percent(None) == fmt_number(None) == ""


def test_labels_keep_what_sets_a_job_apart():
    rows = [{"job": "0", "overrides": "parallelism=single trainer.steps=6"},
            {"job": "1", "overrides": "parallelism=dp2 trainer.steps=6"}]
    common = common_overrides(rows)
    assert common == ["trainer.steps=6"] and [label(r, common) for r in rows] == ["0: parallelism=single",
                                                                                "1: parallelism=dp2"]


def _render(page) -> str:
    """The DOM after the page's scripts ran, as chromium sees it."""
    browser = shutil.which(CHROMIUM)
    if browser is None:
        pytest.fail("Debian's chromium is needed to render report.html: apt-get install -y chromium")
    profile = page.parent / ".chromium-profile"
    r = subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=20000", "--dump-dom",
                        page.as_uri()], capture_output=True, text=True, timeout=180)
    shutil.rmtree(profile, ignore_errors=True)
    assert r.returncode == 0 and "</html>" in r.stdout, r.stderr[-2000:]
    return r.stdout


def test_the_dashboard_renders_every_job_in_headless_chromium(layout_sweep):
    sweep, _ = layout_sweep
    assert report_main([str(sweep)]) == 0
    page = sweep / "report.html"
    source = page.read_text()
    # offline: plotly.js is inside the page, nothing is fetched (no script src, no stylesheet link)
    assert not re.search(r"<script[^>]+src=", source) and not re.search(r"<link[^>]+href=", source)
    assert 'id="moe"' not in source  # a dense sweep: no Mixture-of-Experts section (tests/test_dashboard_moe.py)
    dom = _render(page)

    # the comparison figures + the one pipeline job's timeline, each drawn by plotly, and the
    # page's own layout checks (framework/report/dashboard_checks.py) all pass
    checks = read_checks(dom)
    assert checks["table_fits"] and checks["empty_plots"] == checks["titles_under_toolbar"] == \
        checks["titles_cut"] == checks["bands_off_colour"] == checks["labels_crossed"] == [], checks
    titles = checks["titles"]
    assert checks["plots"] == len(re.findall(r'class="plot-container plotly"', dom)) == 8, titles
    assert titles[:7] == ["Loss against step (training loss lines; held-out val_loss markers)", "Throughput per job",
                          "Tokens/s over the steps (bands: each job's p10-p90 over its measured steps)",
                          "Where each job's step goes (ms per step: medians, means over ranks)",
                          "Memory against throughput (tensor memory of the fullest rank; Pareto front marked)",
                          "Pipeline bubble per job: measured (mean over ranks), the simulator's replay of each run, and "
                          "the schedule's (closed form or schedule model)",
                          "Memory per rank: model states and the activation peak, against the formulas"]
    assert titles[7].startswith("2: parallelism=pp2: step ")  # the timeline of the pipeline job
    assert ", replay " in titles[7] and "vs measured)" in titles[7]  # the simulator's replay of the step under it
    legends = set(re.findall(r'class="legendtext"[^>]*>([^<]*)<', dom))
    names = ["0: parallelism=single", "1: parallelism=dp2", "2: parallelism=pp2"]
    assert set(names) <= legends and {f"{n} (val_loss)" for n in names} <= legends
    assert {"parameters", "gradients", "optimizer states", "activations (peak)", "this configuration's formula",
            "the ZeRO paper's form",
            "forward", "backward", "replay (simulator, the run's own durations)"} <= legends
    assert "replay rank 1" in dom  # the replayed step's rows under the measured ones
    # the numbers drawn on the bars (MFU) or above their error bars (tokens/s: a text trace)
    bar_texts = set(re.findall(r'class="(?:bartext[^"]*|textpoint)"[^>]*>(?:<[^>]*>)*([^<]+)<', dom))
    table = dom[dom.index('<table id="jobs">'):dom.index("</table>")]
    for job, name in enumerate(names):
        s = json.loads((sweep / str(job) / "summary.json").read_text())
        tps = fmt_number(s["tokens_per_s"])
        assert tps in bar_texts and fmt_percent(s["mfu"]) in bar_texts, (tps, bar_texts)  # drawn on the bars
        row = table[table.index(f"<td>{job}</td>"):].split("</tr>")[0]
        for cell in (name.split(": ")[1], s["layout"], "16", "512", fmt_number(s["loss"]), fmt_number(s["val_loss"]),
                     tps, fmt_percent(s["mfu"]), fmt_percent(s["bubble_fraction"]) if s["pp"] > 1 else "n/a",
                     fmt_bytes(s["memory_peak_bytes"])):
            assert f"<td>{cell}</td>" in row or f'<td class="text">{cell}</td>' in row, (cell, row)
    # the x axis of the memory figure: every rank of every job (1 + 2 + 2)
    ticks = re.findall(r">(job \d · rank \d)<", dom)
    assert sorted(set(ticks)) == ["job 0 · rank 0", "job 1 · rank 0", "job 1 · rank 1", "job 2 · rank 0",
                                  "job 2 · rank 1"]


def test_the_dashboard_shows_the_report_s_model_warnings(tmp_path):
    """Jobs that train different models: report.md and report.html carry the report's
    warnings above the table (as `python -m framework.report` writes them), and the table
    gives each job's parameter count. No browser needed: the notes are plain HTML."""
    sweep = fake_sweep(tmp_path, {"0": (["schedule=flush"], 100_000),
                                  "1": (["schedule=1f1b", "model.tie_embeddings=false"], 108_192)})
    warnings = headline(sweep, collect(sweep))[:2]
    assert [w.split(" (")[0] for w in warnings] == ["WARNING: the jobs differ in model.tie_embeddings",
                                                   "WARNING: the jobs differ in model_params"]

    def check_page():
        source = (sweep / "report.html").read_text()
        notes = source[source.index('<div class="notes">'):].split("</div>")[0]
        assert re.findall(r'<p class="warning">([^<]*)</p>', notes) == [html.escape(w) for w in warnings]
        assert "<td>100,000</td>" in source and "<td>108,192</td>" in source

    assert report_main([str(sweep)]) == 0
    assert (sweep / "report.md").read_text().startswith(f"{warnings[0]}\n\n{warnings[1]}\n\n")
    check_page()
    write_dashboard(sweep, collect(sweep), headline(sweep, collect(sweep)))  # the page alone, as report writes it
    check_page()
