"""report.html checks its own layout in the browser (framework/report/dashboard_checks.py):
each check fails on the page it is meant to catch, rendered by headless chromium."""

from __future__ import annotations

from framework.report.dashboard_checks import CHECKS, read_checks
from framework.report.dashboard_parts import _layout, wrap_title

from .test_dashboard import _render


def _page(tmp_path, body: str):
    from plotly.offline import get_plotlyjs

    page = tmp_path / "page.html"
    page.write_text(f'<!DOCTYPE html><html><head><meta charset="utf-8"><script>{get_plotlyjs()}</script></head>'
                    f"<body>{body}<script>{CHECKS}</script></body></html>")
    return page


def _html(fig) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False)


def test_an_empty_chart_a_wide_table_and_a_title_under_the_toolbar_are_caught(tmp_path):
    import plotly.graph_objects as go

    empty = go.Figure(go.Bar(x=["a", "b"], y=[None, None]))
    empty.update_layout(title="an empty chart")
    text = ("a title centred across the whole width of its figure, long enough to reach the toolbar at the top "
            "right of the figure, where plotly draws it, even in a window 1280 pixels wide as the test's")
    centred = go.Figure(go.Bar(x=["a"], y=[1.0]))  # at the top, as a small top margin puts it
    centred.update_layout(title=dict(text=text, y=0.99), margin=dict(t=20))
    wide = '<table id="jobs"><tr>' + "".join(f'<td style="white-space:nowrap">{"w" * 40}</td>' for _ in range(12)) \
        + "</tr></table>"
    checks = read_checks(_render(_page(tmp_path, wide + _html(empty) + _html(centred))))
    assert checks["plots"] == 2 and not checks["table_fits"], checks
    assert checks["empty_plots"] == ["an empty chart"]
    assert [t[:20] for t in checks["titles_under_toolbar"]] == ["a title centred acro"]
    assert [t[:20] for t in checks["titles_cut"]] == ["a title centred acro"]
    # the house style: the same title left-aligned and wrapped clears the toolbar; a table that fits
    fixed = _layout(go.Figure(go.Bar(x=["a"], y=[1.0])), text)
    checks = read_checks(_render(_page(tmp_path, '<table id="jobs"><tr><td>1</td></tr></table>' + _html(fixed))))
    assert checks["table_fits"] and checks["empty_plots"] == checks["titles_under_toolbar"] == checks["titles_cut"] \
        == [], checks


def test_long_titles_wrap_at_spaces():
    assert wrap_title("short") == "short"
    lines = wrap_title(" ".join(["word"] * 40)).split("<br>")
    assert len(lines) == 4 and all(len(x) <= 64 for x in lines) and " ".join(lines) == " ".join(["word"] * 40)


def _jobs():
    """Two jobs with per-step tokens/s and a p10-p90 spread (as summary.json and metrics.jsonl give them)."""
    from framework.report.dashboard_parts import Job

    jobs = []
    for n, tps in enumerate((1000.0, 1500.0)):
        summary = {"tokens_per_s": tps, "tokens_per_step": 512, "step_time_p10_s": 512 / (1.3 * tps),
                   "step_time_p90_s": 512 / (0.6 * tps), "mfu": 0.1 * (n + 1)}
        metrics = [{"step": s, "tokens_per_s": tps * (0.8 + 0.1 * (s % 4))} for s in range(1, 9)]
        jobs.append(Job({"job": str(n), "status": "completed"}, f"{n}: job", summary, metrics))
    return jobs


def test_a_band_off_its_line_s_colour_and_a_label_under_an_error_bar_are_caught(tmp_path):
    """Bad: each band left to plotly's next colour, and the bars' numbers on the bars their
    error bars run through (the dashboard's figures until both were fixed). Good: the
    dashboard's own figures of the same jobs, on the same page."""
    import plotly.graph_objects as go

    from framework.report.dashboard import throughput_figure
    from framework.report.dashboard_compare import steps_figure, throughput_error

    jobs = _jobs()
    bands = go.Figure()
    for j in jobs:
        steps = [r["step"] for r in j.metrics]
        bands.add_trace(go.Scatter(x=[1, 8, 8, 1], y=[600, 600, 1300, 1300], fill="toself", mode="lines",
                                   line=dict(width=0), opacity=0.2, legendgroup=j.label, name=f"{j.label} (p10-p90)"))
        bands.add_trace(go.Scatter(x=steps, y=[r["tokens_per_s"] for r in j.metrics], mode="lines+markers",
                                   name=j.label, legendgroup=j.label))
    _layout(bands, "bands in colours of their own")
    tps = [j.summary["tokens_per_s"] for j in jobs]
    bars = go.Figure(go.Bar(x=[j.label for j in jobs], y=tps, text=[f"{v:,.0f}" for v in tps],
                            error_y=throughput_error(jobs)))
    _layout(bars, "numbers under their error bars")
    page = _page(tmp_path, "".join(_html(f) for f in (bands, bars, steps_figure(jobs), throughput_figure(jobs))))
    checks = read_checks(_render(page))
    assert checks["plots"] == 4, checks
    # plotly's colorway, a colour per trace: job 0's band took the first, its line the second;
    # job 1's the third and fourth. The dashboard's own figures are named in neither list.
    bad = "bands in colours of their own: "
    assert checks["bands_off_colour"] == [bad + "0: job (p10-p90) 99,110,250 vs its line 239,85,59",
                                          bad + "1: job (p10-p90) 0,204,150 vs its line 171,99,250"]
    bad = "numbers under their error bars: "
    assert checks["labels_crossed"] == [bad + "1,000", bad + "1,500"]
