"""bench plots: log TBT axes and spatial-iteration marks per result (CPU, matplotlib Agg)."""
from __future__ import annotations

from matplotlib.figure import Figure

from duetserve.bench.plot import MIN_GAP_MS, plot_results


def _result(start: float, gaps: list[float]) -> dict:
    return {"start_time_unix": start, "duration": 10.0, "tbt_slo_ms": 100.0,
            "requests": [{"error": None, "start_s": 0.0, "ttft_s": 0.05, "itls_s": gaps}]}


def test_each_result_gets_its_own_servers_spatial_marks(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: figures.append(fig))
    a, b = _result(1000.0, [0.01, 0.0, 0.3]), _result(1000.0, [0.02])  # two servers at the same time
    plot_results([a, b], ["duet", "chunked"], tmp_path / "p.png", spatial_by_result=[[1001.0, 1002.0], []])
    _, ax_tbt, ax_time = figures[0].axes
    labels = ax_time.get_legend_handles_labels()[1]
    assert "duet: spatial iterations" in labels and "chunked: spatial iterations" not in labels
    assert ax_tbt.get_xscale() == "log" and ax_time.get_yscale() == "log"
    offsets = ax_time.collections[0].get_offsets()  # duet's gaps in ms; the 0 s gap drawn at the floor
    assert sorted(offsets[:, 1].tolist()) == [MIN_GAP_MS, 10.0, 300.0]
    # one flat list of times (duetserve bench --iteration-log) marks every result inside its window
    plot_results([a, b], ["duet", "chunked"], tmp_path / "q.png", [1001.0])
    labels = figures[1].axes[2].get_legend_handles_labels()[1]
    assert "duet: spatial iterations" in labels and "chunked: spatial iterations" in labels
