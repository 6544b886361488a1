"""timeline.png (framework/metrics/timeline.py) read from the figure's artists, in process: the
communication lanes never take a micro-batch's colour, and their legend hides no bar."""

from __future__ import annotations

import matplotlib.colors as mc
import pytest

from framework.metrics.timeline import gantt_figure

# Two pp ranks, 8 micro-batches (so tab20's every pair, greys included, is drawn) and an update;
# each rank waits in a collective of every dimension, the last span under the chart's top right
# (where the legend used to sit).
RECORDS = [[(f"{op}{mb}", t, t, t + 0.001) for t, (op, mb) in
            enumerate([(op, mb) for mb in range(8) for op in "FB"], start=rank)] + [("U0", 17.0, 17.0, 17.5)]
           for rank in range(2)]
COMM = [[(dim, f"{dim} all-reduce", 2.0 * i + rank, 2.0 * i + rank + 1.5) for i, dim in
         enumerate(("dp", "tp", "pp", "ep", "cp"))] + [("dp", "grad all-reduce", 16.5, 18.0)] for rank in range(2)]


@pytest.fixture
def figure():
    import matplotlib.pyplot as plt

    fig = gantt_figure(RECORDS, "measured", RECORDS, "replay", COMM)
    fig.canvas.draw()  # the legend's place is known once drawn (as savefig draws it)
    yield fig
    plt.close(fig)


def _colour(patch) -> str:
    return mc.to_hex(patch.get_facecolor(), keep_alpha=False)


def test_communication_lanes_have_colours_no_micro_batch_has(figure):
    ax = figure.axes[0]
    comm = [p for p in ax.patches if (p.get_gid() or "").startswith("comm ")]
    compute = [p for p in ax.patches if p not in comm]
    assert len(comm) == 12 and len(compute) == 34  # every span and action drawn
    lanes = {p.get_gid(): _colour(p) for p in comm}
    assert set(lanes) == {f"comm {d}" for d in ("dp", "tp", "pp", "ep", "cp")}
    assert len(set(lanes.values())) == 5, lanes  # one colour per dimension
    updates = {_colour(p) for p, (name, *_) in zip(compute, RECORDS[0] + RECORDS[1]) if name.startswith("U")}
    micro_batches = {_colour(p) for p in compute} - updates
    assert len(micro_batches) == 16 and updates == {"#808080"}  # 8 micro-batches x (forward, backward)
    # greys for communication and updates, hues for micro-batches (tab20's two greys included
    # in none of them), so no lane reads as a micro-batch, drawn here or at any count
    assert all(_grey(c) for c in lanes.values()) and not any(_grey(c) for c in micro_batches), (lanes, micro_batches)
    assert not set(lanes.values()) & (micro_batches | updates | {mc.to_hex(c) for c in _tab20()}), lanes


def _grey(colour: str) -> bool:
    return len({colour[1:3], colour[3:5], colour[5:7]}) == 1


def _tab20() -> list:
    import matplotlib

    return list(matplotlib.colormaps["tab20"].colors)


def test_the_legend_is_outside_every_chart(figure):
    legend = figure.axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["dp comm", "tp comm", "pp comm", "ep comm", "cp comm"]
    box = legend.get_window_extent()
    for ax in figure.axes:  # the measured step's and the replay's data areas
        area = ax.get_window_extent()
        assert not box.overlaps(area), (box, area)
    assert box.x1 <= figure.bbox.x1 + 0.5, (box, figure.bbox)  # and not cut off at the figure's edge
