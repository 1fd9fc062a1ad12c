"""What every benchmark writes: a JSON file of its results and a PNG of its plots."""
from __future__ import annotations

import json
from pathlib import Path


def write_json(path: str | Path, data: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    return path


def subplots(ncols: int, figsize: tuple[float, float] = (10, 4)):
    """(figure, axes) from matplotlib's file-only backend: no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=figsize)


def save_figure(fig, axes, path: str | Path, title: str) -> Path:
    """Grid and legend on every panel, the title on top, written at the repo's usual size."""
    import matplotlib.pyplot as plt

    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
