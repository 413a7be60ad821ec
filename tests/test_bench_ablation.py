"""The ablation's figures (`bench/ablation.py`): the series read from the rows with a variant, and the three PNGs."""

from __future__ import annotations

from PIL import Image

from omnistage.bench.ablation import FIGURES, plot_ablation, series


def _row(variant: str | None, c: int, rps: float, backend: str = "omnistage") -> dict:
    return {"backend": backend, "variant": variant, "concurrency": c, "num_requests": 10 * c,
            "request_throughput": rps, "mean_rtf": 1 / rps, "mean_ttfp_ms": 100 * c / rps}


ROWS = [_row("batch", 16, 5.0), _row("batch", 64, 6.0), _row("+ CUDA graphs", 16, 9.0), _row(None, 16, 99.0),
        _row("+ CUDA graphs", 64, 20.0), _row("batch", 64, 6.5), _row("batch", 32, 1.0, backend="hf")]


def test_series_per_variant_in_first_seen_order() -> None:
    got = series(ROWS, "request_throughput")
    assert list(got) == ["batch", "+ CUDA graphs"]  # the plain row and the peer's are not the ablation's
    assert got == {"batch": {16: 5.0, 64: 6.5}, "+ CUDA graphs": {16: 9.0, 64: 20.0}}  # the later row wins
    assert series(ROWS[3:4], "mean_rtf") == {}


def test_three_figures(tmp_path) -> None:
    paths = plot_ablation({"meta": {"device": "test"}, "rows": ROWS}, tmp_path)
    assert [p.name for p in paths] == list(FIGURES)
    for p in paths:
        assert Image.open(p).size[0] > 500
    assert plot_ablation({"meta": {}, "rows": ROWS[3:4]}, tmp_path / "none") == []
