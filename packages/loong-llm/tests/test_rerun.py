"""Rerunning the same command continues the run: ``loong-llm train`` (no ``run_name``) is SIGKILLed mid-run, the
identical command then continues from the run's newest checkpoint and finishes, and a third identical command says
the run is finished and exits 0 without training or writing anything (docs/checkpoints.md, "Rerunning a command
continues its run"; the rule itself: ``packages/loong-core/tests/test_run_dir.py``).

The killed run is a real process of the CLI (one launch of a few seconds, killed once it has logged step 4, past
the step-3 checkpoint); the reruns run the CLI in-process.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loong.llm.cli import main

pytestmark = pytest.mark.slow

STEPS, SAVE_EVERY, KILL_AFTER = 8, 3, 4


def _args(out: Path) -> list[str]:
    return ["train", f"train.steps={STEPS}", "train.seq_length=32", "train.global_batch_size=4",
            "train.micro_batch_size=1", f"train.save_interval={SAVE_EVERY}", "train.eval_iters=0",
            "train.lr_decay_style=constant", "train.warmup_steps=2", "train.progress=false", f"output_dir={out}"]


def _losses(run: Path) -> list[tuple[int, float]]:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(r["step"], r["train_loss"]) for r in map(json.loads, lines) if "train_loss" in r]


def _rerun(out: Path) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
        rc = main(_args(out))
    sys.stderr.write(err.getvalue())  # shown by pytest on failure
    return rc, err.getvalue()


def _kill_after_step(out: Path, log: Path) -> Path:
    """Start the CLI, SIGKILL it once it has logged step KILL_AFTER; returns its run directory."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOONG_SINGLE_PROCESS")}
    with log.open("w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "loong.llm.cli", *_args(out)], stdout=fh,
                                stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and proc.poll() is None:
                runs = list(out.glob("tiny-*"))
                if runs and any(step >= KILL_AFTER for step, _ in _losses(runs[0])):
                    proc.send_signal(signal.SIGKILL)
                    break
                time.sleep(0.02)
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert rc == -signal.SIGKILL, f"the run was not killed mid-way (exit {rc}):\n{log.read_text()[-3000:]}"
    (run,) = out.glob("tiny-*")
    return run


def test_sigkill_then_the_identical_command_continues_and_then_reports_finished(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = _kill_after_step(out, tmp_path / "killed.log")
    killed = _losses(run)
    assert (run / "checkpoints" / f"step_{SAVE_EVERY:08d}" / "manifest.json").is_file()
    assert not (run / "checkpoints" / f"step_{STEPS:08d}").exists()

    rc, err = _rerun(out)
    assert rc == 0, err[-3000:]
    assert list(out.iterdir()) == [run], "the rerun must continue the run, not start another"
    resumed = next(int(line.rsplit(" ", 1)[1]) for line in err.splitlines() if line.startswith("resumed from"))
    assert f"resumed from {run / 'checkpoints' / f'step_{resumed:08d}'} at step {resumed}" in err
    assert resumed in (SAVE_EVERY, 2 * SAVE_EVERY) and resumed <= max(s for s, _ in killed)
    again = _losses(run)[len(killed):]
    assert [s for s, _ in again] == list(range(resumed + 1, STEPS + 1))
    # steps trained by both attempts (after the resumed checkpoint, before the kill) give the same loss
    overlap = {s: loss for s, loss in killed if s > resumed}
    assert all(dict(again)[s] == loss for s, loss in overlap.items()), (overlap, again)
    assert (run / "checkpoints" / f"step_{STEPS:08d}" / "manifest.json").is_file()

    before = {str(p.relative_to(run)): p.stat().st_mtime_ns for p in run.rglob("*")}
    rc, err = _rerun(out)
    assert rc == 0, err[-3000:]
    lines = err.strip().splitlines()
    assert lines == [f"{run} is finished: its checkpoint step_{STEPS:08d} is at step {STEPS} of train.steps={STEPS}; "
                     "nothing to train (raise train.steps to continue it, or train.resume=none for a new run)"], err
    assert {str(p.relative_to(run)): p.stat().st_mtime_ns for p in run.rglob("*")} == before
    assert list(out.iterdir()) == [run]
