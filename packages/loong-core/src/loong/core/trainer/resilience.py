"""What keeps a long run going: skipped batches, the non-finite policy, and resume compatibility."""

from __future__ import annotations

import bisect
from typing import Any

from loong.core.engines.base import StepMetrics
from loong.core.errors import LoongError


class BatchSchedule:
    """Which global batch step ``s`` trains on: the ``s``-th batch not skipped.

    ``train.on_nonfinite=rollback`` skips the batch that produced NaN/Inf; every later step (in this
    run and after any resume, since the list is checkpointed) moves on by one batch.
    """

    def __init__(self, skipped: list[int] | None = None) -> None:
        self.skipped: list[int] = sorted(set(skipped or []))

    def batch(self, step: int) -> int:
        """The global batch index of step ``step``."""
        b = step
        for k in self.skipped:
            if k <= b:
                b += 1
            else:
                break
        return b

    def skip(self, batch: int) -> None:
        """Never train on ``batch`` again."""
        if batch not in self.skipped:
            bisect.insort(self.skipped, batch)


def nonfinite_diagnostic(step: int, batch: int, metrics: StepMetrics) -> str:
    """One line: which step and batch, which term was not finite, the gradient state and the parameters whose
    gradients were NaN/Inf (the first few, when the loss itself was finite: a NaN loss poisons every one)."""
    grads = "non-finite" if metrics.extra.get("grads_nonfinite") else "finite"
    loss_ok = bool(metrics.extra.get("loss_finite", 0.0))
    line = (f"step {step} (global batch {batch}): the loss term 'loss' is {'finite' if loss_ok else 'NaN/Inf'} "
            f"(reported {metrics.loss}), gradients are {grads}")
    names = metrics.nonfinite_params
    if names and loss_ok:
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        line += f" in {len(names)} parameter{'s' if len(names) > 1 else ''} ({shown})"
    if metrics.nonfinite_origin:
        line += f"; {metrics.nonfinite_origin}"
    elif metrics.extra.get("grads_nonfinite") and loss_ok:
        line += "; train.nonfinite_probe=true names where the backward first produced it"
    return line


def model_differences(saved: dict[str, Any], current: dict[str, Any], prefix: str = "model") -> list[str]:
    """``key: saved vs current`` for every model setting that differs (paths to HF folders ignored)."""
    out = []
    for key in sorted(set(saved) | set(current)):
        if key == "init_from_hf":
            continue
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(model_differences(a, b, f"{prefix}.{key}"))
        elif a != b:
            out.append(f"{prefix}.{key}={a!r} in the checkpoint, {b!r} now")
    return out


def check_same_model(step_dir: Any, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Raise LoongError when a full checkpoint was saved for another model than this run's."""
    diffs = model_differences(saved or {}, current or {})
    if diffs:
        shown = "; ".join(diffs[:4]) + (f"; and {len(diffs) - 4} more" if len(diffs) > 4 else "")
        raise LoongError(f"checkpoint {step_dir} was saved for another model ({shown}); resume with its "
                         "model settings, or start a new run (another run_name, or train.resume=none)")
