"""`--nproc-per-node N` relaunches the command through torch.distributed.run (a real 2-process run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "LOONG_SINGLE_PROCESS")}


@pytest.mark.slow
def test_nproc_per_node_relaunches_and_trains_at_tp2(tmp_path: Path) -> None:
    env = _env()
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


@pytest.mark.slow
def test_a_config_the_workers_refuse_exits_2_through_the_launcher(tmp_path: Path) -> None:
    # seq_length 33 does not split over tp=2 under sequence parallelism: a check the workers make (it needs the
    # layout), so the launcher must pass their exit code 2 on instead of torchrun's 1
    proc = subprocess.run(
        [sys.executable, "-m", "loong.llm.cli", "train", "--nproc-per-node", "2", "parallel.tp=2",
         "parallel.sequence_parallel=true", "train.seq_length=33", "train.steps=1", "train.progress=false",
         f"output_dir={tmp_path}", "run_name=bad"],
        capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "train.seq_length=33 must divide by parallel.tp=2" in proc.stderr
    assert not (tmp_path / "bad").exists()
