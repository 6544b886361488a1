"""The dashboard checks its own layout once plotly has drawn it (report.html's last script):
the jobs' table fits the page's width, no panel is an empty chart, and no figure's title
lies under plotly's toolbar (the modebar) or runs past its figure's right edge (cut off). The result is written into the page as
`<body data-checks="{...}">`, so a headless browser's DOM dump carries it
(tests/test_dashboard.py reads it with `read_checks`); a person opening the page sees
nothing of it."""

from __future__ import annotations

import html
import json
import re
from typing import Optional

CHECKS = """
(function () {
  function points(trace) {
    var ys = trace.y || trace.z || [], xs = trace.x || [], n = 0;
    for (var i = 0; i < Math.max(ys.length, xs.length); i++) {
      var y = ys.length ? ys[i] : xs[i];
      if (y !== null && y !== undefined && !(typeof y === 'number' && isNaN(y))) n++;
    }
    return n;
  }
  function overlap(a, b) {
    return b.width > 0 && a.width > 0 && a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom;
  }
  function run() {
    var out = {table_fits: true, table_width: 0, page_width: document.documentElement.clientWidth,
               empty_plots: [], titles_under_toolbar: [], titles_cut: [], titles: [], plots: 0};
    var table = document.getElementById('jobs');
    if (table) {
      out.table_width = Math.ceil(table.getBoundingClientRect().right);
      out.table_fits = out.table_width <= out.page_width;
    }
    document.querySelectorAll('.js-plotly-plot').forEach(function (gd) {
      out.plots++;
      var title = gd.querySelector('.gtitle'), lines = title ? title.querySelectorAll('tspan.line') : [];
      var name = !title ? '(untitled)' : lines.length ? Array.prototype.map.call(lines, function (l) {
        return l.textContent; }).join(' ') : title.textContent;
      out.titles.push(name);
      if ((gd.data || []).reduce(function (n, t) { return n + points(t); }, 0) === 0) out.empty_plots.push(name);
      var bar = gd.querySelector('.modebar');
      if (title && bar && overlap(title.getBoundingClientRect(), bar.getBoundingClientRect()))
        out.titles_under_toolbar.push(name);
      if (title && title.getBoundingClientRect().right > gd.getBoundingClientRect().right + 1)
        out.titles_cut.push(name);  // wider than its figure: the end is not drawn
    });
    document.body.setAttribute('data-checks', JSON.stringify(out));
  }
  window.addEventListener('load', function () { setTimeout(run, 1500); });  // after plotly's text layout
})();
"""


def read_checks(dom: str) -> Optional[dict]:
    """The checks' result from a rendered page's DOM (None when the script did not run)."""
    m = re.search(r'<body[^>]*\sdata-checks="([^"]*)"', dom)
    return json.loads(html.unescape(m.group(1))) if m else None
