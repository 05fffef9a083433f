"""Bad input to ``loong-diffusion`` fails fast and cleanly: exit code 2, one ``error: ...`` line naming the file or
key, no traceback, and nothing written (no output directory, nothing in the working directory, an existing output
folder left byte for byte). Each case runs the real CLI in-process (``main([...])``); the inputs are built once."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loong.core.testing import clean_failure_cli, unchanged, write_checkpoint_corpus
from loong.diffusion.cli import main
from loong.diffusion.models.wan import WanTransformer, save_diffusers, wan_preset
from loong.diffusion.models.wan.mapping import WEIGHTS_NAME

TRAIN = ["train.steps=1", "train.progress=false", "run_name=r", "data.frames=2", "data.height=8", "data.width=8",
         "train.global_batch_size=2", "train.micro_batch_size=2"]


def _variant(src: Path, dst: Path, edit=None, config: str | None = None) -> None:  # noqa: ANN001
    """A copy of the diffusers folder ``src``, its tensors passed through ``edit``, its config.json replaced."""
    shutil.copytree(src, dst)
    if edit is not None:
        tensors = load_file(src / WEIGHTS_NAME)
        edit(tensors)
        save_file(tensors, dst / WEIGHTS_NAME)
    if config is not None:
        (dst / "config.json").write_text(config)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Diffusers folders, checkpoints and shard folders that are wrong in one way each, and a good checkpoint."""
    d = tmp_path_factory.mktemp("diffusion_corpus")
    torch.manual_seed(0)
    good = save_diffusers(WanTransformer(wan_preset("tiny")).state_dict(), wan_preset("tiny"), d / "good")
    names = sorted(load_file(good / WEIGHTS_NAME))
    key = next(k for k in names if k.endswith("attn1.to_q.weight"))
    _variant(good, d / "broken_config", config='{"_class_name": "WanTransformer3DModel", "num_layers": ')
    _variant(good, d / "other_class", config=json.dumps({"_class_name": "UNet2DConditionModel", "in_channels": 4}))
    _variant(good, d / "missing", edit=lambda t: t.pop(key))
    _variant(good, d / "extra", edit=lambda t: t.update({"blocks.0.attn1.to_q.lora_A": torch.zeros(2, 2)}))
    _variant(good, d / "shape", edit=lambda t: t.update({key: torch.zeros(t[key].shape[0], t[key].shape[1] + 1)}))
    _variant(good, d / "dtype", edit=lambda t: t.update({key: t[key].to(torch.int32)}))
    shutil.copytree(good, d / "truncated")
    weights = d / "truncated" / WEIGHTS_NAME
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    # foreign_ckpt: a loong-llm run's checkpoint (another modality's model section); newer_ckpt: manifest format 99
    write_checkpoint_corpus(d)
    (d / "no_index").mkdir()
    (d / "bad_index").mkdir()
    (d / "bad_index" / "index.json").write_text('{"format": "loong-diffusion-shards", ')
    assert main(["convert", str(good), str(d / "ckpt")]) == 0  # a good earlier conversion, to be kept
    return d


@pytest.fixture
def cli(tmp_path: Path) -> Callable[..., str]:
    """``cli(*argv)``: run ``loong-diffusion`` from an empty cwd, assert the clean-failure contract, return the
    line."""
    return clean_failure_cli(main, tmp_path, train=TRAIN)


CONVERT_CASES = [  # (source, the text the line holds; {d}: the corpus folder)
    ("broken_config", "{d}/broken_config/config.json: not valid JSON"),
    ("other_class", "a UNet2DConditionModel config is not a Wan transformer (WanTransformer3DModel)"),
    ("missing", "{d}/missing: the weights do not match its config.json (missing ["),
    ("extra", "{d}/extra: the weights do not match its config.json (missing [], unexpected ["),
    ("shape", "{d}/shape: blocks.0.attn1.to_q.weight has shape"),
    ("dtype", "{d}/dtype: blocks.0.attn1.to_q.weight is torch.int32"),
    ("truncated", "{d}/truncated/diffusion_pytorch_model.safetensors: cannot read safetensors file"),
    ("foreign_ckpt", "is not a loong-diffusion checkpoint"),
    ("newer_ckpt", "checkpoint format 99; this Loong reads format 1"),
]


@pytest.mark.parametrize("name,expected", CONVERT_CASES, ids=[n for n, _ in CONVERT_CASES])
def test_convert_bad_source_keeps_the_existing_output(cli, corpus: Path, tmp_path: Path, name: str,
                                                      expected: str) -> None:
    with unchanged(tmp_path / "dst", copy_of=corpus / "ckpt") as dst:
        msg = cli("convert", str(corpus / name), str(dst))
    assert expected.format(d=corpus) in msg and str(corpus / name) in msg, msg


TRAIN_CASES = [  # (override, the text the line holds)
    ("train.resume={d}/foreign_ckpt", "train.resume: {d}/foreign_ckpt/checkpoints/step_00000000 is not a checkpoint "
                                      "of this CLI's models"),
    ("train.resume={d}/newer_ckpt", "checkpoint format 99; this Loong reads format 1"),
    ("model.init_from_diffusers={d}/broken_config", "{d}/broken_config/config.json: not valid JSON"),
    ("model.init_from_diffusers={d}/shape", "{d}/shape: blocks.0.attn1.to_q.weight has shape"),
    ("data.source=shards data.path={d}/no_index", "data.path: {d}/no_index has no index.json"),
    ("data.source=shards data.path={d}/bad_index", "data.path: {d}/bad_index/index.json is not valid JSON"),
]


@pytest.mark.parametrize("override,expected", TRAIN_CASES, ids=[o.split("/")[-1] for o, _ in TRAIN_CASES])
def test_train_bad_input(cli, corpus: Path, override: str, expected: str) -> None:
    msg = cli("train", *override.format(d=corpus).split())
    assert expected.format(d=corpus) in msg and len(msg) < 500, msg


@pytest.mark.parametrize("name,expected", [
    ("foreign_ckpt", "is not a loong-diffusion checkpoint"),
    ("newer_ckpt", "checkpoint format 99; this Loong reads format 1"),
])
def test_sample_refuses_a_bad_model(cli, corpus: Path, tmp_path: Path, name: str, expected: str) -> None:
    gif = tmp_path / "sample.gif"
    msg = cli("sample", str(corpus / name), "--device", "cpu", "--steps", "1", "--no-progress", "-o", str(gif))
    assert expected.format(d=corpus) in msg, msg
    assert not gif.exists()
