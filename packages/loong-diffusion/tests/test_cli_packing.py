"""``loong-diffusion train`` with packing: mixed ``data.sizes`` under ``data.pack_tokens`` train, log the plan's
figures, and give every step the loss of the unpacked run over the same clips (``train.micro_batch_size=1``, one
clip a micro-batch): the same global batches, the same clip-mean loss, so the same updates."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from loong.diffusion.cli import main

SIZES = "data.sizes=[[4,16,16],[2,8,8],[4,8,16]]"  # 256, 32 and 128 video tokens
COMMON = ["train.steps=3", "train.progress=false", "train.eval_interval=3", "train.eval_iters=1",
          "train.save_final=false", SIZES]


def _run(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
        rc = main(["train", *COMMON, f"output_dir={tmp_path}", f"run_name={name}", *overrides])
    assert rc == 0, err.getvalue()
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("model", ["tiny", "tiny_i2v", "tiny_ti2v"])
def test_packed_mixed_sizes_train_as_the_unpacked_run(tmp_path: Path, model: str) -> None:
    # image-to-video: I2V's channels and CLIP tokens, TI2V's clean first frame left out of the loss, in packs too
    extra = (f"model={model}", "data.image_len=3")
    packed = _run(tmp_path, "packed", "data.pack_tokens=512", *extra)
    plain = _run(tmp_path, "plain", "train.micro_batch_size=1", *extra)
    steps = [r for r in packed if "train_loss" in r]
    assert len(steps) == 3 and all(r["micro_batches"] >= 2 and 0 < r["pack_fill"] <= 1 for r in steps)
    assert [r["train_loss"] for r in steps] == pytest.approx([r["train_loss"] for r in plain if "train_loss" in r],
                                                             rel=1e-5)
    evaluated = [[r["eval_loss"] for r in run if "eval_loss" in r] for run in (packed, plain)]
    assert evaluated[0] == pytest.approx(evaluated[1], rel=1e-5)


def test_mixed_sizes_without_packing_need_one_clip_a_micro_batch(tmp_path: Path) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
        rc = main(["train", SIZES, f"output_dir={tmp_path / 'out'}"])
    assert rc == 2 and "data.pack_tokens" in err.getvalue() and "train.micro_batch_size" in err.getvalue()
    assert not (tmp_path / "out").exists()
