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
