"""VLM → VLA across packages (issue 24): a Qwen3-VL trained by ``loong-vlm`` starts GR00T N1.7's backbone.

The handoff is a Hugging Face folder: ``loong-vlm convert <run> <dst>`` writes one, and ``loong-embodied train
model.policy=groot_n1_7 model.config.base_model_path=<dst>`` takes the backbone's shape from its config.json and its
weights from its safetensors (loong-embodied never imports loong-vlm). With the backbone frozen its weights after
training are the step-0 weights, so they must equal the folder's kept tensors (``lm_head`` and the decoder layers at
and above ``select_layer`` left out) bit for bit; a run from the preset's random backbone has another first loss.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from loong.embodied.cli import main as embodied_main
from loong.vlm.cli import main as vlm_main

VLM = ["model=tiny_qwen3_vl", "train.steps=2", "train.progress=false", "train.global_batch_size=2",
       "train.micro_batch_size=2", "train.log_interval=1", "train.eval_interval=0"]
VLA = ["train", "model.policy=groot_n1_7", "model.preset=tiny", "model.config.tune_llm=false",
       "model.config.tune_visual=false", "train.steps=2", "data.synthetic_episodes=4", "train.progress=false",
       "train.eval_interval=0", "train.eval_iters=0", "train.global_batch_size=2", "train.micro_batch_size=2",
       "train.log_interval=1"]
SELECT_LAYER = 2  # the tiny GR00T preset's: the 4-layer VLM keeps decoder layers 0 and 1


def _embodied(*argv: str) -> tuple[int, str]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = embodied_main(list(argv))
        except SystemExit as exc:
            rc = int(exc.code or 0)
    return rc, out.getvalue() + err.getvalue()


def _first_loss(run: Path) -> float:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return next(r["train_loss"] for r in records if "train_loss" in r)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vlm")
    assert vlm_main(["train", *VLM, f"output_dir={out}", "run_name=vlm"]) == 0
    assert vlm_main(["convert", str(out / "vlm"), str(out / "hf")]) == 0
    return out / "hf"


def test_a_converted_vlm_starts_the_groot_backbone(hf_folder: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from loong.core.checkpoint import resolve_checkpoint
    from loong.core.checkpoint.inspect import checkpoint_tensors

    hf = load_file(str(hf_folder / "model.safetensors"))
    kept = {}
    for key, value in hf.items():
        if not key.startswith("model."):
            continue
        name = key.removeprefix("model.")
        if name.startswith("language_model.layers.") and int(name.split(".")[2]) >= SELECT_LAYER:
            continue
        kept["model.backbone." + name] = value
    assert any(".layers.3." in k for k in hf) and not any(".layers.2." in k for k in kept)

    rc, log = _embodied(*VLA, f"model.config.base_model_path={hf_folder}", f"output_dir={tmp_path}",
                        "run_name=from_vlm")
    assert rc == 0, log
    weights = checkpoint_tensors(resolve_checkpoint(tmp_path / "from_vlm"))
    backbone = {k: v for k, v in weights.items() if k.startswith("model.backbone.")}
    assert set(backbone) == set(kept)
    for key, value in kept.items():
        assert torch.equal(backbone[key], value), key
    policy = json.loads((tmp_path / "from_vlm" / "policy" / "policy.json").read_text())["config"]
    assert policy["backbone"]["text_config"]["intermediate_size"] == 192  # the VLM's shape, not the preset's 128

    rc, log = _embodied(*VLA, f"output_dir={tmp_path}", "run_name=random")
    assert rc == 0, log
    assert _first_loss(tmp_path / "random") != pytest.approx(_first_loss(tmp_path / "from_vlm"), rel=1e-4)


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda c: c["text_config"].update(vocab_size=100), "text_config.vocab_size 100 is below"),
    (lambda c: c.update(image_token_id=9), "image_token_id is 9"),
    (lambda c: c["vision_config"].update(intermediate_size=96), "model.visual.blocks.0.mlp.linear_fc1.weight has "
                                                                "shape [128, 64], backbone.visual.blocks.0.mlp"),
])
def test_a_folder_that_does_not_fit_is_refused(hf_folder: Path, tmp_path: Path, edit, expected: str) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((hf_folder / "config.json").read_text())
    edit(config)
    (bad / "config.json").write_text(json.dumps(config))
    shutil.copy(hf_folder / "model.safetensors", bad / "model.safetensors")
    rc, log = _embodied(*VLA, f"model.config.base_model_path={bad}", f"output_dir={tmp_path / 'o'}")
    assert rc == 2, log
    assert "model.config.base_model_path" in log and expected in log and "Traceback" not in log, log
    assert not (tmp_path / "o").exists()


def test_init_from_and_base_model_path_together_are_refused(hf_folder: Path, tmp_path: Path) -> None:
    rc, log = _embodied(*VLA, f"model.config.base_model_path={hf_folder}", f"model.init_from={hf_folder}",
                        f"output_dir={tmp_path / 'o'}")
    assert rc == 2 and "model.init_from and model.config.base_model_path" in log and "Traceback" not in log, log
    assert not (tmp_path / "o").exists()
