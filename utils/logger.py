"""What a run shows while it trains: a progress bar, tables of samples, a history of metrics, and (only if asked)
wandb."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from tabulate import tabulate
from tqdm.std import tqdm as _text_bar


def _in_jupyter_kernel() -> bool:
    """Whether this process is a Jupyter kernel (a notebook's, Colab's, VS Code's), as tqdm.autonotebook tells."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


class tqdm(_text_bar):
    """tqdm's text bar (`tqdm.std.tqdm`), on stdout in a Jupyter kernel and on stderr elsewhere, as tqdm's default
    (so that a script's stdout holds only its figures, which the tests parse).

    Why not `tqdm.auto`'s widget: a notebook keeps of a widget only the text made when the bar was created, unless
    the widgets' state is saved too (JupyterLab does not by default), so a saved and reopened notebook shows
    "0/150" however far the bar went. A text bar redraws its line with a carriage return, which Jupyter, Colab and
    VS Code show in place while it runs and again when the notebook is reopened: the saved output is the bar's last
    state. stdout, because notebooks show stderr on a red background, as if something had gone wrong.
    """

    def __init__(self, *args, **kwargs):
        if "file" not in kwargs and len(args) < 5 and _in_jupyter_kernel():  # file is tqdm's fifth argument
            kwargs["file"] = sys.stdout
        super().__init__(*args, **kwargs)


def samples_table(rows: list[dict], max_chars: int = 60, floatfmt: str = ".3f") -> str:
    """A plain-text table of samples, one row each; long strings are cut to `max_chars` (with an ellipsis)."""
    if not rows:
        return "(no samples)"

    def cell(value):
        if isinstance(value, str):
            value = value.replace("\n", "\\n")
            return value if len(value) <= max_chars else value[:max_chars - 1] + "…"
        return value

    return tabulate([{k: cell(v) for k, v in row.items()} for row in rows], headers="keys", floatfmt=floatfmt,
                    tablefmt="simple_outline")


class RunLogger:
    """Collects metrics step by step; mirrors them to wandb only when `use_wandb` is True.

    wandb needs no account with WANDB_MODE=offline (runs are written under ./wandb, to sync later if you like).
    """

    def __init__(self, use_wandb: bool = False, project: str = "rlhf-from-first-principles",
                 config: dict | None = None, run_name: str | None = None):
        self.history: list[dict] = []
        self.run = None
        if use_wandb:
            try:
                import wandb
            except ImportError as e:
                raise ImportError("use_wandb=True needs the wandb package: pip install wandb") from e
            if os.environ.get("WANDB_MODE") is None and not os.environ.get("WANDB_API_KEY"):
                os.environ["WANDB_MODE"] = "offline"  # no account configured: never prompt for one
            self.run = wandb.init(project=project, config=config or {}, name=run_name, reinit="finish_previous")

    def log(self, metrics: dict, step: int) -> None:
        self.history.append({"step": step, **metrics})
        if self.run is not None:
            self.run.log(metrics, step=step)

    def curve(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric, skipping the steps that did not log it."""
        points = [(h["step"], h[key]) for h in self.history if key in h]
        return [s for s, _ in points], [v for _, v in points]

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def run_steps(steps: int, step: Callable[[int], dict], logger: RunLogger, desc: str, shown: tuple[str, ...],
              evaluate: Callable[[], float] | None = None,
              evaluate_at: Callable[[int], bool] = lambda step: False) -> RunLogger:
    """The training loop of Parts 3 and 5: step(0), ..., step(steps - 1), each one's metrics logged at its step, and
    `evaluate()` (logged as "accuracy", where given) before each step i with evaluate_at(i) and once more after the
    last step. The bar counts the steps (the final evaluation is not one) and shows the metrics named in `shown`.
    Returns the logger, finished."""
    bar = tqdm(total=steps, desc=desc, unit="step")
    for i in range(steps + 1):
        metrics = {}
        if evaluate is not None and (i == steps or evaluate_at(i)):
            metrics["accuracy"] = evaluate()
        if i < steps:  # the last pass only evaluates the final model
            metrics |= step(i)
        logger.log(metrics, step=i)
        bar.set_postfix({k: f"{v:.3f}" for k, v in metrics.items() if k in shown}, refresh=False)
        bar.update(1 if i < steps else 0)
    bar.close()
    logger.finish()
    return logger


def print_figures(figures: dict, as_json: bool = False) -> None:
    """Print a script's figures one per line, aligned; with `as_json`, end with one line that is a JSON object of
    them (what the tests and benchmarks parse)."""
    import json

    width = max((len(str(k)) for k in figures), default=0)
    print("\n".join(f"{key:>{width}}: {value}" for key, value in figures.items()))
    if as_json:
        print(json.dumps(figures))
