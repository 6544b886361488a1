"""The Mixture-of-Experts section of report.html (framework/report/dashboard_moe.py), drawn by
headless chromium from a real sweep: ep 1 and ep 2 of a tiny MoE model (conftest's
`moe_sweep`). A dense sweep has no such section (tests/test_dashboard.py)."""

from __future__ import annotations

import json
import re

from framework.report.dashboard import Job, fmt_percent
from framework.report.dashboard_moe import MAX_LAYERS, a2a_share, load_heatmap, shown_layers
from framework.report.compare import main as report_main
from framework.report.dashboard_checks import read_checks

from .test_dashboard import _render

LABELS = ["0: parallelism.ep=1", "1: parallelism.ep=2"]  # the sweep's common overrides left out


def _jobs(sweep) -> list[Job]:
    out = []
    for n, name in enumerate(LABELS):
        folder = sweep / str(n)
        metrics = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        out.append(Job({"job": str(n)}, name, json.loads((folder / "summary.json").read_text()), metrics, folder))
    return out


def test_the_moe_section_renders_in_headless_chromium(moe_sweep):
    assert report_main([str(moe_sweep)]) == 0
    dom = _render(moe_sweep / "report.html")
    assert dom.count('id="moe"') == 1
    section = dom[dom.index('<div id="moe-section">'):]
    checks = read_checks(dom)  # the page's own layout checks (dashboard_checks.py): all pass
    assert checks["table_fits"] and checks["empty_plots"] == checks["titles_under_toolbar"] == \
        checks["titles_cut"] == [], checks
    titles = checks["titles"][-4:]  # the MoE section's (wrapped titles: their lines joined)
    assert titles == ["Expert load imbalance: the worst layer's coefficient of variation of tokens per expert "
                      "(moe_load_cv_max; 0 = even)",
                      "All-to-all share of the step (a2a_s / step_time_s, median over measured steps; host seconds)",
                      *(f"{name}: tokens routed to each expert, per step and MoE layer" for name in LABELS)]
    # every figure drawn: 4 plots, 2 heat maps (layers 0 and 1) in each job's figure
    plots = section.split('class="plot-container plotly"')[1:]
    assert len(plots) == 4
    assert [p.count('<g class="hm"><image') for p in plots] == [0, 0, 2, 2]
    assert [re.findall(r'data-unformatted="(layer \d)"', p) for p in plots[2:]] == [["layer 0", "layer 1"]] * 2
    assert set(LABELS) <= set(re.findall(r'class="legendtext"[^>]*>([^<]*)<', plots[0]))  # a CV line per job
    assert len(re.findall(r'class="point"', plots[0])) == 2 * 4  # 4 steps each
    # the all-to-all bar: only the ep 2 job, its median share written on the bar
    jobs = _jobs(moe_sweep)
    assert a2a_share(jobs[0]) is None
    share, seconds, nbytes = a2a_share(jobs[1])
    assert 0 < share < 1 and seconds > 0 and nbytes > 0
    assert re.findall(r'class="bartext[^"]*"[^>]*>(?:<[^>]*>)*([^<]+)<', plots[1]) == [fmt_percent(share)]
    ticks = re.findall(r'class="xtick"[^>]*>(?:<[^>]*>)*([^<]+)<', plots[1])
    assert ticks == [LABELS[1]], ticks


def test_a_heat_map_holds_the_tokens_per_expert_of_every_step(moe_sweep):
    job = _jobs(moe_sweep)[1]
    fig = load_heatmap(job)
    assert [t.type for t in fig.data] == ["heatmap", "heatmap"]
    for layer, trace in zip(("0", "1"), fig.data, strict=True):
        assert list(trace.x) == [r["step"] for r in job.metrics] == [1, 2, 3, 4]
        assert list(trace.y) == [0, 1, 2, 3]  # 4 experts
        assert [list(row) for row in trace.z] == [[r["moe_layers"][layer]["tokens_per_expert"][e] for r in job.metrics]
                                                  for e in range(4)]
        assert sum(trace.z[e][0] for e in range(4)) == 512 * 2  # 512 tokens a step, top-2: nothing dropped


def test_many_layers_are_spread_over_the_depth_and_the_rest_named():
    assert shown_layers(["0", "1"]) == ["0", "1"]
    layers = [str(i) for i in range(12)]
    assert shown_layers(layers) == ["0", "2", "3", "5", "6", "8", "9", "11"]  # first and last kept
    rows = [{"step": s, "moe_layers": {i: {"tokens_per_expert": [1.0, 2.0, 3.0]} for i in layers}} for s in (1, 2)]
    fig = load_heatmap(Job({"job": "0"}, "0: big", {}, rows))
    assert len(fig.data) == MAX_LAYERS
    assert fig.layout.title.text.replace("<br>", " ").endswith("(8 of 12 layers shown; left out: 1, 4, 7, 10)")
