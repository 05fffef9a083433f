"""`--nproc-per-node N` relaunches the command through torch.distributed.run (a real 2-process run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_nproc_per_node_relaunches_and_trains_at_tp2(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "LOONG_SINGLE_PROCESS")}
    proc = subprocess.run(
        [sys.executable, "-m", "loong.llm.cli", "train", "--nproc-per-node", "2", "parallel.tp=2",
         "train.steps=3", "train.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=2",
         "train.eval_iters=0", "train.progress=false", f"output_dir={tmp_path}", "run_name=l"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 2: tp=2 pp=1 dp=1" in proc.stderr
    state = json.loads((tmp_path / "l" / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["layout"]["world_size"] == 2 and state["layout"]["tp"] == 2
    steps = [json.loads(x)["step"] for x in (tmp_path / "l" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # one logging rank writes, not two
