"""The dashboard checks its own layout once plotly has drawn it (report.html's last script):
the jobs' table fits the page's width, no panel is an empty chart, no figure's title
lies under plotly's toolbar (the modebar) or runs past its figure's right edge (cut off), a
band (a filled trace) is painted in its line's colour (the trace of its legendgroup; alpha
aside: `bands_off_colour`), and no number on a chart is struck through by an error bar
(`labels_crossed`). The result is written into the page as
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
  function rgb(colour) {  // 'r,g,b' of any CSS colour, its alpha left out
    var ctx = document.createElement('canvas').getContext('2d');
    ctx.fillStyle = '#000';
    ctx.fillStyle = colour || '#000';
    var c = ctx.fillStyle;  // '#rrggbb' when opaque, else 'rgba(r, g, b, a)'
    if (c.charAt(0) === '#') return [1, 3, 5].map(function (i) { return parseInt(c.substr(i, 2), 16); }).join(',');
    return c.match(/[0-9.]+/g).slice(0, 3).map(Number).join(',');
  }
  function drawn(gd) {  // each drawn scatter trace: its data (d3's binding), its fill and its line as painted
    return Array.prototype.map.call(gd.querySelectorAll('.scatterlayer g.trace'), function (g) {
      var fill = g.querySelector('path.js-fill'), line = g.querySelector('path.js-line');
      return {trace: g.__data__ && g.__data__[0] && g.__data__[0].trace,
              fill: fill && fill.getAttribute('d') ? fill.style.fill : null, line: line ? line.style.stroke : null};
    }).filter(function (t) { return t.trace; });
  }
  function bandsOffColour(gd, name, out) {
    // A band (a filled trace) and the line it bands share a legendgroup: same colour, alpha aside
    var traces = drawn(gd);
    traces.forEach(function (band) {
      if (!band.fill || !band.trace.legendgroup) return;
      var line = traces.filter(function (t) {
        return t !== band && !t.fill && t.line && t.trace.legendgroup === band.trace.legendgroup; })[0];
      if (line && rgb(band.fill) !== rgb(line.line))
        out.bands_off_colour.push(name + ': ' + band.trace.name + ' ' + rgb(band.fill) + ' vs its line ' +
                                  rgb(line.line));
    });
  }
  function labelsCrossed(gd, name, out) {
    // A number on a chart (a bar's text, a text trace's) that an error bar runs through
    var errors = Array.prototype.map.call(gd.querySelectorAll('g.errorbar path'), function (p) {
      return p.getBoundingClientRect(); });
    gd.querySelectorAll('text.bartext, g.textpoint text').forEach(function (t) {
      var box = t.getBoundingClientRect();
      if (t.textContent && errors.some(function (e) { return overlap(box, e); }))
        out.labels_crossed.push(name + ': ' + t.textContent);
    });
  }
  function run() {
    var out = {table_fits: true, table_width: 0, page_width: document.documentElement.clientWidth,
               empty_plots: [], titles_under_toolbar: [], titles_cut: [], titles: [], plots: 0,
               bands_off_colour: [], labels_crossed: []};
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
      bandsOffColour(gd, name, out);
      labelsCrossed(gd, name, out);
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
