"""LLM → VLM across packages (issue 24): a checkpoint written by ``loong-llm train`` starts a VLM's foundation.

``loong-vlm train foundation.init_from=<llm run>`` takes the foundation's shape from the checkpoint's config and its
weights from the checkpoint (any layout it was saved at). With the foundation frozen (projector and encoder
alignment on a fixed LLM, LLaVA's first stage) its weights after training are the step-0 weights, so they must
equal the LLM's bit for bit; a second run that trains the foundation too starts from the same weights (the same
first loss) and moves them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loong.llm.cli import main as llm_main
from loong.vlm.cli import main as vlm_main

#: an LLM of the tiny VLM foundation's width (qwen2_5_tiny: hidden 64, 4 heads, 2 KV groups, qkv bias)
LLM_SHAPE = ["model.family=qwen2", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=192",
             "model.num_attention_heads=4", "model.num_query_groups=2", "model.vocab_size=640",
             "model.qkv_bias=true", "model.tie_word_embeddings=true"]
COMMON = ["train.progress=false", "train.global_batch_size=2", "train.micro_batch_size=2", "train.log_interval=1",
          "train.eval_interval=0"]


def _losses(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["train_loss"] for r in records if "train_loss" in r]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from megatron.core.dist_checkpointing.serialization import load_plain_tensors

    from loong.core.checkpoint import resolve_checkpoint
    from loong.llm.checkpoint_init import process_group

    with process_group():
        return load_plain_tensors(str(resolve_checkpoint(run)))


@pytest.fixture(scope="module")
def llm_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llm")
    assert llm_main(["train", *COMMON, *LLM_SHAPE, "train.steps=3", "train.seq_length=64", f"output_dir={out}",
                     "run_name=llm"]) == 0
    return out / "llm"


def test_an_llm_checkpoint_starts_the_vlm_foundation(llm_run: Path, tmp_path: Path) -> None:
    from loong.core.checkpoint import read_config, resolve_checkpoint
    from loong.llm.checkpoint_init import read_model_weights

    _, llm, _ = read_model_weights(llm_run)
    base = ["train", *COMMON, "train.steps=3", f"foundation.init_from={llm_run}", f"output_dir={tmp_path}"]
    assert vlm_main([*base, "run_name=frozen", "model.freeze=[foundation]"]) == 0
    frozen = _weights(tmp_path / "frozen")
    vlm_foundation = {k.removeprefix("foundation."): v for k, v in frozen.items() if k.startswith("foundation.")}
    assert set(vlm_foundation) == set(llm)
    for key, value in llm.items():
        assert torch.equal(vlm_foundation[key], value), key
    saved = read_config(resolve_checkpoint(tmp_path / "frozen"))
    assert saved["foundation"]["num_layers"] == 2  # the checkpoint's shape, not the preset's 4 layers

    assert vlm_main([*base, "run_name=trained"]) == 0
    trained = _weights(tmp_path / "trained")
    assert _losses(tmp_path / "trained")[0] == pytest.approx(_losses(tmp_path / "frozen")[0], rel=1e-6)
    moved = [k for k in llm if not torch.equal(trained["foundation." + k], llm[k])]
    assert moved, "the unfrozen foundation did not train"


def test_a_checkpoint_that_is_not_an_llm_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "empty").mkdir()
    rc = vlm_main(["train", *COMMON, f"foundation.init_from={tmp_path / 'empty'}", f"output_dir={tmp_path / 'o'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "foundation.init_from" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_an_llm_checkpoint_starts_another_llm_run(llm_run: Path, tmp_path: Path) -> None:
    """``loong-llm train model.init_from=<run>``: the checkpoint's shape (2 layers, over the tiny preset's 4) and
    weights; with ``train.lr=0`` its one step leaves them as they were loaded."""
    from loong.core.checkpoint import read_config, resolve_checkpoint
    from loong.llm.checkpoint_init import read_model_weights

    _, llm, _ = read_model_weights(llm_run)
    assert llm_main(["train", *COMMON, "train.steps=1", "train.seq_length=64", "train.lr=0", "train.min_lr=0",
                     f"model.init_from={llm_run}", f"output_dir={tmp_path}", "run_name=warm"]) == 0
    again = _weights(tmp_path / "warm")
    assert read_config(resolve_checkpoint(tmp_path / "warm"))["model"]["num_layers"] == 2
    for key, value in llm.items():
        assert torch.equal(again[key], value), key
