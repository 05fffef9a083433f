"""Every model field is either in a Hugging Face config.json or a training field that ``init_from_hf`` keeps.

``model.init_from_hf`` builds the model config from the folder's config.json and takes the rest
(:data:`~loong.llm.models.config.TRAINING_FIELDS`: recompute, kernels, DSA stage, ...) from the run's config. A field
in neither place would be silently reset to its default by ``init_from_hf`` (``model.recompute=full`` once was).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from loong.core.config import compose_config
from loong.llm.hf import model_config_from_hf
from loong.llm.models.config import TRAINING_FIELDS, DenseModelConfig, LoraConfig
from loong.llm.models.hf_mapping import family_by_name
from loong.llm.schema import LLMRunConfig

PRESETS = ["llama3_2_1b", "qwen2_5_0_5b", "qwen3_0_6b", "qwen3_30b_a3b_4l", "deepseek_v3_4l", "deepseek_v3_2_4l"]

# a value other than the default for every training field
CHANGED = {"init_from_hf": "somewhere", "init_from": "elsewhere", "init_std": 0.005, "fused_kernels": "off", "recompute": "full",
           "recompute_num_layers": 2, "moe_token_dispatcher": "allgather", "moe_grouped_mm": True,
           "moe_router_bias_update_rate": 0.01, "mtp_loss_scaling_factor": 0.3, "dsa_stage": "dense_warmup",
           "indexer_loss_coeff": 0.5, "dsa_head_chunks": 4, "lora": LoraConfig(rank=4)}


def _preset(name: str) -> DenseModelConfig:
    cfg, _ = compose_config("loong.llm.configs", "pretrain", [f"model={name}"], LLMRunConfig)
    return cfg.model


def _write_config_json(model: DenseModelConfig, folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(family_by_name(model.family).hf_config_dict(model)))
    return folder


@pytest.mark.parametrize("preset", PRESETS)
def test_config_json_holds_every_field_but_the_training_ones(preset: str, tmp_path: Path) -> None:
    model = dataclasses.replace(_preset(preset), mtp_num_layers=0)  # MTP is read from the folder's weights
    back = model_config_from_hf(_write_config_json(model, tmp_path / "hf"))
    # head_dim None means hidden_size / heads: compare what it resolves to
    model, back = (dataclasses.replace(m, head_dim=m.kv_channels) for m in (model, back))
    lost = {f.name: (getattr(model, f.name), getattr(back, f.name)) for f in dataclasses.fields(DenseModelConfig)
            if f.name not in (*TRAINING_FIELDS, "preset", "extra") and getattr(model, f.name) != getattr(back, f.name)}
    assert not lost, f"fields neither in config.json nor in TRAINING_FIELDS (ours, read back): {lost}"


@pytest.mark.parametrize("preset", ["llama3_2_1b", "deepseek_v3_2_4l"])
def test_init_from_hf_keeps_every_training_field(preset: str, tmp_path: Path) -> None:
    assert set(CHANGED) == set(TRAINING_FIELDS)
    model = _preset(preset)
    ours = dataclasses.replace(model, **CHANGED)
    assert all(getattr(ours, k) != getattr(model, k) for k in CHANGED)
    back = model_config_from_hf(_write_config_json(model, tmp_path / "hf"), keep=ours)
    assert {k: getattr(back, k) for k in CHANGED} == CHANGED
