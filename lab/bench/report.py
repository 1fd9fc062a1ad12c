"""What every benchmark writes and prints: a JSON file of its results, a PNG of its plots,
percentiles and short model names for its tables."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

from sled.extras import require_extra


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-th percentile: percentile([1, 2, 3, 4, 5], 50) == 3."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def short_name(spec: str) -> str:
    """A model or drafter spec for a table: hf:/a/b/llama-drafter -> hf:llama-drafter,
    /a/b/llama-target -> llama-target; gguf:gemma3-270m unchanged."""
    kind, sep, arg = spec.rpartition(":")
    return f"{kind}{sep}{Path(arg).name}" if "/" in arg else spec


def write_json(path: str | Path, data: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    return path


def pyplot():
    """matplotlib.pyplot on its file-only backend: no display needed. The lab's one way to start
    plotting (matplotlib, the lab extra, is imported only when a plot is drawn: a bench that
    plots nothing runs without it)."""
    require_extra("lab", "plotting results")
    import matplotlib   # optional: the lab extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # optional: the lab extra

    return plt


def subplots(ncols: int, figsize: tuple[float, float] = (10, 4)):
    """(figure, axes) of one row of ncols panels."""
    return pyplot().subplots(1, ncols, figsize=figsize)


def save_figure(fig, axes, path: str | Path, title: str) -> Path:
    """Grid and legend on every panel, the title on top, written at the repo's usual size."""
    import matplotlib.pyplot as plt   # optional: the lab extra

    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle(textwrap.fill(title, 110))      # a long setup line wraps, never clips
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
