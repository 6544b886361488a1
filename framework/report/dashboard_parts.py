"""What the sweep dashboard's modules share (framework/report/dashboard.py, the page; framework/
dashboard_moe.py, its MoE section): the job record, units and number formats, the figure style."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


@dataclass
class Job:
    row: dict
    label: str
    summary: dict
    metrics: list[dict] = field(default_factory=list)
    folder: Optional[Path] = None


def byte_unit(largest: float) -> tuple[str, int]:
    """The unit a byte axis reads best in: the largest one the biggest value is at least 1 of."""
    return next((name, size) for name, size in UNITS if largest >= size or size == 1)


def fmt_bytes(value: Optional[float]) -> str:
    if value is None:
        return ""
    name, size = byte_unit(value)
    return f"{value / size:.1f} {name}" if size > 1 else f"{value:.0f} B"


def fmt_percent(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.1%}"


def fmt_number(value: Optional[float], digits: int = 4) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


# A job's colour where a figure draws more than one trace per job (a line and its band): set, not
# left to plotly, which gives every trace the next colour (a band would not match its line).
JOB_COLOURS = ("#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3", "#ff6692", "#b6e880", "#ff97ff",
               "#fecb52")  # plotly_white's own colorway


def rgba(colour: str, alpha: float) -> str:
    """'#rrggbb' at opacity `alpha`, as plotly reads it."""
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r}, {g}, {b}, {alpha})"


TITLE_CHARS = 64  # a title line's most characters: left-aligned, it fits a ~700 px figure and ends before the toolbar


def wrap_title(title: str) -> str:
    """A long title on several lines (<br>), broken at spaces."""
    lines, line = [], ""
    for word in title.split(" "):
        if line and len(line) + 1 + len(word) > TITLE_CHARS:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return "<br>".join([*lines, line])


def _layout(fig, title: str, **kwargs):
    """The house style: the title left-aligned and wrapped, so it never runs under plotly's
    toolbar at the top right (report.html checks that: dashboard_checks.py)."""
    text = wrap_title(title)
    below_toolbar = 40  # px from the top: plotly's toolbar takes the top ~32 px at the right
    height = kwargs.get("height", 450)
    fig.update_layout(title=dict(text=text, x=0.01, xanchor="left", y=1 - below_toolbar / height, yanchor="top"),
                      template="plotly_white", margin=dict(l=70, r=30, t=below_toolbar + 30 + 22 * text.count("<br>"),
                                                           b=60),
                      legend=dict(orientation="h", y=-0.25), **kwargs)
    return fig
