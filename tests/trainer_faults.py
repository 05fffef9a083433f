"""Faults for any modality's real run, through the public seams only (used by ``test_one_trainer.py``).

- :func:`sigkill_after_step`: the modality's CLI as a real process, SIGKILLed once it has logged a step (so the kill
  lands inside the next step, or inside its checkpoint write: wherever the process happens to be);
- :func:`sigterm_after_step`: the CLI in this process, sent SIGTERM by a watcher thread once it has logged a step;
- :func:`nan_batch_task`: a test-only task, registered beside the modality's own, that turns every floating tensor
  of one global batch's micro-batches into NaN every time that batch is drawn (the ``Task.train_microbatches``
  seam, which every engine calls): ``train.on_nonfinite`` then has a real non-finite step to act on.

Nothing in the packages is patched.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from loong.core.registry import TASKS

#: what a test worker must not inherit from a pytest that itself runs under a launcher
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOONG_SINGLE_PROCESS")


def logged_losses(run: Path) -> list[tuple[int, float]]:
    """``(step, train_loss)`` of every line of the run's ``metrics.jsonl``, in order (every attempt's lines)."""
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(r["step"], r["train_loss"]) for r in map(json.loads, lines) if "train_loss" in r]


def metrics(run: Path) -> list[dict[str, Any]]:
    """Every record of the run's ``metrics.jsonl``."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def run_in_process(cli_module: str, argv: list[str]) -> tuple[int, str]:
    """``main(argv)`` of ``loong.<modality>.cli`` in this process; returns (exit code, everything it printed)."""
    main = importlib.import_module(cli_module).main
    out = io.StringIO()
    with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
        rc = main(argv)
    sys.stderr.write(out.getvalue())  # shown by pytest when the test fails
    return rc, out.getvalue()


def start_cli(cli_module: str, argv: list[str], log: Path) -> subprocess.Popen:
    """The CLI as a real process (``python -m loong.<modality>.cli ...``), its output in ``log`` (a file, not a
    pipe: nothing a killed process leaves behind can keep the test waiting)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as fh:
        return subprocess.Popen([sys.executable, "-m", cli_module, *argv], stdout=fh, stderr=subprocess.STDOUT,
                                env=env)


def sigkill_after_step(proc: subprocess.Popen, run: Path, step: int, log: Path, timeout_s: float = 300) -> None:
    """SIGKILL ``proc`` as soon as ``run`` has logged ``step`` (and a checkpoint before it is complete); fails when
    the process ends by itself first."""
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            if any(s >= step for s, _ in logged_losses(run)):
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.02)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == -signal.SIGKILL, f"the run was not killed mid-way (exit {rc}):\n{log.read_text()[-3000:]}"


def sigterm_after_step(cli_module: str, argv: list[str], run: Path, step: int) -> tuple[int, str]:
    """Run the CLI in this process and send this process SIGTERM once ``run`` has logged ``step`` in this attempt.

    The trainer handles SIGTERM while it trains; a signal that came after it had already given its handler back
    lands in this function's own handler instead of ending pytest, and fails the call."""
    already = len(logged_losses(run))
    done, late = threading.Event(), []

    def watch() -> None:
        while not done.is_set():
            if any(s >= step for s, _ in logged_losses(run)[already:]):
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.01)

    previous = signal.signal(signal.SIGTERM, lambda *_: late.append(True))
    watcher = threading.Thread(target=watch, daemon=True)
    try:
        watcher.start()
        rc, out = run_in_process(cli_module, argv)
    finally:
        done.set()
        watcher.join()
        time.sleep(0.05)  # a signal sent just before the join is delivered to this process's handler by now
        signal.signal(signal.SIGTERM, previous)
    assert not late, f"SIGTERM came after training ended (the run finished before step {step}?):\n{out[-3000:]}"
    return rc, out


def _poisoned(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.full_like(value, float("nan")) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _poisoned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_poisoned(v) for v in value)
    return value


def _has_float(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_floating_point()
    if isinstance(value, dict):
        return any(_has_float(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_float(v) for v in value)
    return False


def nan_batch_task(task: str, batch: int) -> str:
    """Register (once) a task that is ``task`` except that global batch ``batch`` comes out NaN; returns its name."""
    name = f"test.nan_batch{batch}.{task}"
    base = TASKS.get(task)

    class NaNBatch(base):  # type: ignore[misc, valid-type]
        def train_microbatches(self, step: int, num_microbatches: int) -> Iterator[dict]:
            microbatches = super().train_microbatches(step, num_microbatches)
            if step != batch:
                return microbatches
            return (_checked_poison(mb) for mb in microbatches)

    NaNBatch.__name__ = NaNBatch.__qualname__ = f"NaNBatch{batch}{base.__name__}"
    with contextlib.suppress(ValueError):  # registered by an earlier test of this session
        TASKS.register(name)(NaNBatch)
    return name


def _checked_poison(microbatch: Any) -> Any:
    assert _has_float(microbatch), f"a micro-batch without a floating tensor to turn NaN: {list(microbatch)}"
    return _poisoned(microbatch)
