"""Every policy's tiny preset trains under DDP (``parallel.fsdp=none``) with every part it can tune trainable.

DDP stops at the second step when a trainable parameter got no gradient in the first ("Expected to have finished
reduction in the prior iteration"), so this is the check that each policy leaves nothing trainable that its loss
never reaches (GR00T N1.7's truncated decoder skips the text model's final norm and the last deepstack merger)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from loong.embodied.cli import main

pytestmark = pytest.mark.slow

RUN = ["data.synthetic_episodes=12", "train.progress=false", "train.eval_interval=0", "train.eval_iters=0",
       "train.steps=2", "train.global_batch_size=4", "train.micro_batch_size=2", "parallel.fsdp=none",
       "train.save_final=false", "train.resume=none"]

#: the tiny presets with every tuning flag their policy has switched on
TINY = {
    "pi05": ["policy=pi05_tiny"],
    "groot_n1_7": ["policy=groot_n1_7_tiny", "model.config.tune_llm=true", "model.config.tune_visual=true"],
    "groot_n1_6": ["policy=groot_n1_6_tiny", "model.config.tune_llm=true", "model.config.tune_visual=true"],
}


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ddp")  # one synthetic dataset for all the runs (<out>/.cache)


@pytest.mark.parametrize("policy", sorted(TINY))
def test_tiny_policy_trains_under_ddp(out: Path, policy: str) -> None:
    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
            rc = main(["train", f"output_dir={out}", f"run_name={policy}", *RUN, *TINY[policy]])
        except SystemExit as exc:
            rc = int(exc.code or 0)
    assert rc == 0, log.getvalue()[-4000:]
    assert "DDP" in log.getvalue()
    assert "in 2 steps" in log.getvalue()
