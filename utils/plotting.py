"""Plots: the backend every figure of the course is drawn with, and training curves, one small panel per metric."""

from __future__ import annotations

from pathlib import Path

# Backends under which a figure can be saved as it is: Agg (no display), and a notebook's inline backend
SAVES_AS_IS = ("agg", "module://matplotlib_inline.backend_inline")


def pyplot_for(path: str | Path | None = None):
    """matplotlib.pyplot, ready for a figure that will be saved to `path` (None: shown, in a notebook). A script that
    saves its figures needs no display, and on a machine without one a GUI backend fails: so when `path` is given,
    Agg is chosen, unless Agg or a notebook's inline backend already is."""
    import matplotlib

    if path is not None and matplotlib.get_backend().lower() not in SAVES_AS_IS:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(history: list[dict], keys: list[str], title: str | None = None, path: str | Path | None = None,
                xlabel: str = "step"):
    """Plot each metric of `keys` against the "step" of a RunLogger history's entries; save to `path` if given.

    `xlabel` names what a step is on the x-axis (e.g. "phase" for PPO, whose logger counts rollout phases).

    Returns the matplotlib Figure (a notebook shows it; a script can save or close it).
    """
    plt = pyplot_for(path)
    missing = [k for k in keys if not any(k in h for h in history)]
    if missing:
        raise KeyError(f"no logged values for {missing}; logged keys are "
                       f"{sorted({k for h in history for k in h} - {'step'})}")
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3), squeeze=False)
    for ax, key in zip(axes[0], keys):
        points = [(h["step"], h[key]) for h in history if key in h]
        ax.plot([s for s, _ in points], [v for _, v in points], marker="." if len(points) < 40 else None)
        ax.set_title(key)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig
