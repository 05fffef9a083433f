"""``loong-diffusion train`` under context parallelism: Ulysses over 2 gloo processes reads the same samples and
trains the same steps as one process (the task's sharded loss, end to end through the fsdp engine)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from wan_testing import train_losses, worker_env

from loong.diffusion.cli import main

pytestmark = pytest.mark.slow

COMMON = ["train.steps=4", "train.progress=false", "train.eval_interval=0", "train.save_final=false"]




def test_ulysses_2_trains_as_one_process(tmp_path: Path) -> None:
    assert main(["train", *COMMON, f"output_dir={tmp_path}", "run_name=one"]) == 0
    # a fresh process: an in-process run leaves this one's distributed environment behind (its port, the
    # single-process flag), which the relaunched workers would inherit
    env = worker_env()
    proc = subprocess.run([sys.executable, "-m", "loong.diffusion.cli", "train", "--nproc-per-node", "2", *COMMON,
                           "parallel.cp_ulysses=2", f"output_dir={tmp_path}", "run_name=cp2"],
                          capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cp=2 (ulysses 2 x ring 1)" in proc.stderr
    one, cp2 = train_losses(tmp_path / "one"), train_losses(tmp_path / "cp2")
    assert len(one) == len(cp2) == 4
    assert cp2 == pytest.approx(one, rel=1e-5)  # measured: equal to 2e-7 (fp32, gloo)
