"""GPU checks of loong-vlm (run on an accelerator machine: ``pytest -m gpu``).

The embedded default (the tiny Qwen2.5-VL-style VLM on the synthetic shapes set) trains on CUDA in the accelerator's
default precision (bf16) and learns as it does on CPU; and its foundation in bf16 on the GPU stays about as close to
transformers' fp32 model as transformers' own bf16 run does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from foundation_cases import batch, hf_logits, hf_model, rel  # noqa: E402

pytestmark = pytest.mark.gpu


def test_the_default_run_trains_in_bf16_on_the_gpu(tmp_path: Path) -> None:
    from loong.vlm.cli import main

    if not torch.cuda.is_available():
        pytest.fail("gpu tests need CUDA")
    code = main(["train", "train.steps=30", "train.progress=false", f"output_dir={tmp_path}", "run_name=g"])
    assert code == 0
    records = [json.loads(line) for line in (tmp_path / "g" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train_loss" in r]
    assert len(train) == 30 and all(torch.isfinite(torch.tensor(r["train_loss"])) for r in train)
    assert train[-1]["train_loss"] <= 0.7 * train[0]["train_loss"], (train[0], train[-1])
    assert train[-1]["peak_memory_gib"] > 0
    assert (tmp_path / "g" / "checkpoints" / "latest").is_file()


@pytest.mark.parametrize("case", ["qwen2_5_vl", "qwen3_vl"])
@torch.no_grad()
def test_bf16_foundation_is_as_close_to_fp32_transformers_as_its_bf16(case: str) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from loong.core.accelerators import select_accelerator
    from loong.core.config.schema import ParallelConfig
    from loong.core.engines.megatron.layout import world
    from loong.core.engines.megatron.state import load_full_state
    from loong.llm.models.build import transformer_config
    from loong.vlm.models.foundation import build_foundation
    from loong.vlm.models.text_mapping import select_text, text_config_from_hf, text_hf_to_native

    if not torch.cuda.is_available():
        pytest.fail("gpu tests need CUDA")
    hf = hf_model(case)
    bt = batch(case, hf)
    exact = hf_logits(hf.cuda(), _to(bt, "cuda")).double()
    hf_bf16 = hf_logits(hf.to(torch.bfloat16), _to(bt, "cuda", torch.bfloat16)).double()
    text = text_config_from_hf(hf.float().config.to_dict())
    acc = select_accelerator("cuda")
    with world(acc) as layout:
        model_parallel_cuda_manual_seed(0)
        tc = transformer_config(text.model, ParallelConfig(), torch.bfloat16, acc.megatron_config_overrides())
        ours = build_foundation(text.model, tc, acc.capabilities(), True, True, layout.pg_collection, None,
                                text.mrope_section, text.mrope_interleaved,
                                deepstack_layers=len(bt.deepstack))
        load_full_state([ours], text_hf_to_native(select_text(hf.float().cpu().state_dict()), text.model))
        ours = ours.cuda().eval()
        b = _to(bt, "cuda", torch.bfloat16)
        got = ours(b.input_ids, b.position_ids, None, visual_embeds=b.visual_embeds, visual_mask=b.visual_mask,
                   deepstack_embeds=b.deepstack or None).double()
    assert got.dtype == exact.dtype and got.shape == exact.shape
    assert rel(got, exact) <= 2 * rel(hf_bf16, exact) + 1e-3, (rel(got, exact), rel(hf_bf16, exact))


def _to(bt, device: str, dtype: torch.dtype = torch.float32):  # noqa: ANN001, ANN202
    """The batch on ``device``, its float tensors (visual rows, DeepStack features) in ``dtype``."""
    import dataclasses

    return dataclasses.replace(
        bt, input_ids=bt.input_ids.to(device), position_ids=bt.position_ids.to(device),
        visual_mask=bt.visual_mask.to(device), visual_embeds=bt.visual_embeds.to(device, dtype),
        deepstack=[d.to(device, dtype) for d in bt.deepstack], labels=bt.labels.to(device))
