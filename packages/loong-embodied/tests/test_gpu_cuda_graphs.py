"""``train.cuda_graphs`` with the policies that declare their step capture-safe (``pytest -m gpu``; CI deselects
these, and without CUDA they skip).

Each capture-safe policy's tiny preset trains 8 steps in bf16 on the synthetic reach dataset, without FSDP
(``parallel.fsdp=none``), twice: eagerly and with ``train.cuda_graphs=true``. The graphed run logs the eager run's
losses (the captured kernels are the eager ones, and each micro-batch draws its noise, time and dropout from the
seed the task gives it, replayed or not) and says it captured the step.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from loong.embodied.cli import main
from loong.embodied.policies import POLICIES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TINY = {"pi05": "policy=pi05_tiny", "groot_n1_7": "policy=groot_n1_7_tiny", "groot_n1_6": "policy=groot_n1_6_tiny"}
RUN = ["data.synthetic_episodes=12", "train.progress=false", "train.eval_interval=0", "train.eval_iters=0",
       "train.steps=8", "train.global_batch_size=8", "train.micro_batch_size=4", "train.precision=bf16",
       "parallel.fsdp=none", "train.save_final=false", "train.resume=none"]


def _train(out: Path, name: str, *argv: str) -> tuple[list[float], str]:
    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
            rc = main(["train", f"output_dir={out}", f"run_name={name}", *RUN, *argv])
        except SystemExit as exc:
            rc = int(exc.code or 0)
    assert rc == 0, log.getvalue()[-4000:]
    lines = (out / name / "metrics.jsonl").read_text().splitlines()
    return [r["train_loss"] for r in map(json.loads, lines) if "train_loss" in r], log.getvalue()


@pytest.mark.parametrize("policy", [p for p in sorted(TINY) if POLICIES.get(p).policy_class.cuda_graph_safe])
def test_graphed_run_logs_the_eager_losses(tmp_path: Path, policy: str) -> None:
    eager, _ = _train(tmp_path, "eager", TINY[policy])
    graphed, log = _train(tmp_path, "graphs", TINY[policy], "train.cuda_graphs=true")
    assert "train.cuda_graphs: captured the step" in log
    assert len(graphed) == len(eager) == 8
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=1e-4, atol=0)
