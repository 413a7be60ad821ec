"""What every bench figure ends with (`save`): its legend, layout, PNG file."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save(fig: Any, ax: Any, path: Path) -> Path:
    """`fig` (matplotlib, its one axes `ax`) written to `path` as a PNG and closed."""
    import matplotlib.pyplot as plt

    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
