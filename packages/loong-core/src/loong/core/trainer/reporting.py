"""What a run writes for people to look at: progress bar, metrics.jsonl, TensorBoard, loss PNG."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class Reporter:
    """Writes metrics on the logging rank; every method is a no-op elsewhere."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, enabled: bool,
                 show_progress: bool, console: Console | None = None) -> None:
        self.enabled = enabled
        self.run_dir = run_dir
        self.console = console or Console(stderr=True)
        self.history: list[dict[str, Any]] = []
        self._writer = None
        self._progress: Progress | None = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (run_dir / "metrics.jsonl").open("a")
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(run_dir / "tensorboard"))
        if show_progress:
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[speed]}"),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                console=self.console, transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step,
                                                 loss="-", speed="")

    def log(self, record: dict[str, Any]) -> None:
        """Append one record (must hold ``step``) to metrics.jsonl and TensorBoard."""
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        self.history.append(record)
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        step = record["step"]
        for key, value in record.items():
            if key not in ("step", "time") and isinstance(value, (int, float)):
                self._writer.add_scalar(key.replace("_", "/", 1) if key.startswith(("train_", "eval_"))
                                        else key, value, step)

    def advance(self, step: int, loss: float, tokens_per_s: float, mfu: float | None) -> None:
        """Move the progress bar to ``step``."""
        if self._progress is None:
            return
        speed = f"{tokens_per_s:,.0f} tok/s" + (f" MFU {mfu:.1%}" if mfu is not None else "")
        self._progress.update(self._task, completed=step, loss=f"{loss:.4f}", speed=speed)

    def print(self, message: str) -> None:
        """A line above the progress bar."""
        if self.enabled:
            self.console.print(message, soft_wrap=True)  # one line: logs get grepped

    def close(self, plot: bool = True) -> Path | None:
        """Stop the bar, flush files and (``plot``) draw the loss curve; returns the PNG path."""
        if not self.enabled or self._jsonl.closed:
            return None
        if self._progress is not None:
            self._progress.stop()
        self._jsonl.close()
        self._writer.close()
        if not plot:
            return None
        return plot_loss(self.run_dir / "metrics.jsonl", self.run_dir / "loss.png")


def plot_loss(metrics_path: Path, out: Path) -> Path | None:
    """Training (and evaluation) loss against step, from a metrics.jsonl file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [(r["step"], r["train_loss"]) for r in records if "train_loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    if not train:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(*zip(*train, strict=True), label="train", linewidth=1.2)
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"loss — {metrics_path.parent.name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
