"""The ablation's figures (as the seed's: throughput, RTF and TTFP per server configuration and concurrency): one
group of bars per concurrency, one bar per variant in the order the rows first name them. Rows with a `variant`
(`omnistage bench --variant NAME`, one server per variant: `scripts/gpu_ablation.sh`) are the ablation's."""

from __future__ import annotations

from pathlib import Path

from omnistage.bench.figures import save

FIGURES = {"ablation_throughput.png": ("request_throughput", "requests / s"),
           "ablation_rtf.png": ("mean_rtf", "mean RTF (below 1: faster than real time)"),
           "ablation_ttfp.png": ("mean_ttfp_ms", "mean TTFP (ms)")}


def series(rows: list[dict], key: str) -> dict[str, dict[int, float]]:
    """{variant: {concurrency: the row's `key`}} of the omnistage rows with a variant, variants in first-seen
    order (a later row of the same variant and concurrency replaces an earlier one)."""
    out: dict[str, dict[int, float]] = {}
    for r in rows:
        if r.get("variant") and r.get("backend") == "omnistage" and r.get(key) is not None and r.get("num_requests"):
            out.setdefault(r["variant"], {})[r["concurrency"]] = r[key]
    return out


def plot_ablation(results: dict, out_dir: str | Path) -> list[Path]:
    """The three figures into `out_dir` (none without ablation rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, (key, label) in FIGURES.items():
        data = series(results["rows"], key)
        if not data:
            continue
        levels = sorted({c for v in data.values() for c in v})
        width = 0.8 / len(data)
        fig, ax = plt.subplots(figsize=(7.2, 4.2))
        for i, (variant, values) in enumerate(data.items()):
            xs = [j + (i - (len(data) - 1) / 2) * width for j, c in enumerate(levels) if c in values]
            ax.bar(xs, [values[c] for c in levels if c in values], width, label=variant)
        ax.set_xticks(range(len(levels)), [f"c = {c}" for c in levels])
        ax.set(ylabel=label, title=f"{label} ({results['meta'].get('device', '')})")
        ax.grid(True, axis="y", alpha=0.3)
        paths.append(save(fig, ax, Path(out_dir) / name))
    return paths
