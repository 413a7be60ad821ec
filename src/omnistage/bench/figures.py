"""The sweep's figures (`plot`: throughput / TTFP / RTF against concurrency) and what every bench figure ends
with (`save`): its legend, layout, PNG file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omnistage.bench.realtime_metrics import is_realtime

# file -> (row key, axis label)
PLOTS = {"throughput.png": ("request_throughput", "requests / s"), "ttfp.png": ("mean_ttfp_ms", "mean TTFP (ms)"),
         "rtf.png": ("mean_rtf", "mean RTF (below 1: faster than real time)")}


def save(fig: Any, ax: Any, path: Path) -> Path:
    """`fig` (matplotlib, its one axes `ax`) written to `path` as a PNG and closed."""
    import matplotlib.pyplot as plt

    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(results: dict, out_dir: str | Path) -> list[Path]:
    """throughput / TTFP / RTF against concurrency, one line per (backend, workload, prompt length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    series: dict[tuple[str, str, int], list[dict]] = {}
    for row in results["rows"]:
        if not is_realtime(row) and row["num_requests"] and not row.get("variant"):  # ablation rows: table only
            key = (row["backend"], row.get("workload") or "read-aloud", row["prompt_tokens"])
            series.setdefault(key, []).append(row)
    paths = []
    for name, (key, label) in PLOTS.items() if series else ():
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for (backend, workload, p), rows in sorted(series.items()):
            pts = sorted((r["concurrency"], r[key]) for r in rows if r.get(key) is not None)
            label = f"{backend} P={p}" if workload == "read-aloud" else f"{backend} {workload}"
            if pts:
                ax.plot(*zip(*pts), "o-" if backend == "omnistage" else "s--", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["concurrency"] for rows in series.values() for r in rows}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set(xlabel="concurrency (hf: batch size)", ylabel=label, title=f"{label} ({results['meta']['device']})")
        ax.grid(True, alpha=0.3)
        paths.append(save(fig, ax, Path(out_dir) / name))
    return paths
