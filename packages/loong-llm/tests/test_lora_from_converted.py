"""LoRA on top of a converted (weights-only) checkpoint: the adapters are new, the base is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loong.llm.cli import main

COMMON = ["train.steps=3", "train.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=2",
          "train.eval_iters=0", "train.progress=false"]


def _losses(run: Path) -> list[float]:
    return [r["train_loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "train_loss" in r]


@pytest.mark.slow
def test_lora_trains_from_converted_checkpoint(tiny_llama_hf: Path, tmp_path: Path) -> None:
    assert main(["convert", str(tiny_llama_hf), str(tmp_path / "conv")]) == 0
    base = ["train", f"train.resume={tmp_path / 'conv'}", *COMMON, f"output_dir={tmp_path}"]
    assert main([*base, "run_name=full"]) == 0
    assert main([*base, "run_name=lora", "model.lora.rank=4"]) == 0
    config = (tmp_path / "lora" / "checkpoints" / "step_00000003" / "config.yaml").read_text()
    assert "rank: 4" in config  # the command line's model.lora wins over the checkpoint's model
    full, lora = _losses(tmp_path / "full"), _losses(tmp_path / "lora")
    assert abs(full[0] - lora[0]) <= 1e-6 * abs(full[0])  # B = 0: same base weights, same first loss
    assert full[1:] != lora[1:]  # different parameters train
