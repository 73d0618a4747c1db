"""bench/plot.py draws the benchmark's plot (make bench): the figure's title
sits above the two panels' titles, not on top of them. Needs matplotlib,
which make bench installs into build/bench-venv, not into the test Python:
without it this skips, saying so."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_plot():
    spec = importlib.util.spec_from_file_location("bench_plot", os.path.join(ROOT, "bench", "plot.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def host_rows():
    """Raw rows as bench/run.sh --host writes them: at 8 GiB in two chunk
    sizes a floor, a cache hit and first transfers at several windows; at
    1 GiB the host rows (bench/hostrows.py). A figure as tall as make
    bench's (31 inches), where the titles met: tight_layout put the panels'
    titles at the top and the figure's title 2% of the height below it."""
    rows = []
    for path in ("hostbuffer", "sharedmemory", "bytes"):
        for again in (False, True):
            for send in (1, 2):
                rows.append(dict(approach="hostrows", N=512, chunk_size=2 << 20, ok=True, memory="host",
                                 path=path, again=again, send=send, ms=1.1, sampled=send == 1,
                                 peak_fds_sender=0, peak_fds_receiver=1))
    for n, chunk in ((4096, 2 << 20), (410, 20 << 20)):
        rows.append(dict(approach="floor", N=n, chunk_size=chunk, ok=True, memory="host", floor_ms=9.3,
                         export_held_fds=n, held_fds=n, contended_export_us_per_chunk=1.0))
        for sampled in (False, True):
            common = dict(N=n, chunk_size=chunk, ok=True, memory="host", sampled=sampled,
                          peak_fds_sender=1, peak_fds_receiver=4)
            for window in (0, 1, 2, 4, 8, 32, 64, 128, 256, 512, 1024):
                rows.append(dict(approach="first", window=window, ms=0.5, **common))
            rows.append(dict(approach="repeated", round=1, cache=True, ms=0.15, **common))
    return rows


@pytest.mark.parametrize("host", [True, False], ids=["host", "cuda"])
def test_plot_title_clears_the_panel_titles(host, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed here: make bench installs it into "
                        "build/bench-venv (build/bench-venv/bin/python -m pip install pytest to run this there)")
    import matplotlib.figure

    plot = load_plot()
    rows = [dict(r, memory="host" if host else "cuda") for r in host_rows()]
    _, _, by_config, is_host = plot.report(rows, 16)
    assert is_host == host
    drawn = []
    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(fig, *args, **kwargs):
        drawn.append(fig)
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    png = tmp_path / "bench.png"
    assert plot.plot(by_config, host, str(png))
    assert png.stat().st_size > 0 and len(drawn) == 1
    fig = drawn[0]
    renderer = fig.canvas.get_renderer()
    title = fig._suptitle.get_window_extent(renderer)
    for ax in fig.axes:  # y grows upwards: the figure's title starts above where each panel's title ends
        panel = ax.title.get_window_extent(renderer)
        assert title.y0 >= panel.y1, \
            f"the figure's title ({title}) is not above the panel title {ax.get_title()!r} ({panel})"
