"""Tiny random Qwen VLMs (transformers, built in-process) and their batches, shared by ``test_foundation.py`` and
its multi-process worker ``workers/foundation_tp.py``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, rms_norm_eps=1e-6, max_position_embeddings=512)
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64)
DEEPSTACK = 2  # Qwen3-VL cases: DeepStack features for the first two of the three decoder layers
CASES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
IMAGE_TOKEN, VIDEO_TOKEN = TEXT["vocab_size"] - 1, TEXT["vocab_size"] - 2  # the placeholders; text ids are below


def hf_config(case: str):  # noqa: ANN201
    """A tiny config of ``case``: 3 text layers of width 64, heads of 16 channels (8 rotary frequencies)."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig, Qwen3VLMoeConfig

    if case == "qwen2_5_vl":  # 16 / 64 of the head's frequencies: Qwen2.5-VL's [16, 24, 24] scaled down
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        return Qwen2_5_VLConfig(text_config=dict(TEXT, rope_parameters=rope), vision_config=dict(VISION),
                                tie_word_embeddings=False)
    # Qwen3-VL's [24, 20, 20] scaled down: temporal takes the rest of the interleave
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    vision = dict(VISION, deepstack_visual_indexes=list(range(DEEPSTACK)), depth=DEEPSTACK)
    if case == "qwen3_vl":
        return Qwen3VLConfig(text_config=dict(TEXT, head_dim=16, rope_parameters=rope), vision_config=vision,
                             tie_word_embeddings=False)
    # experts: D=64, F=24 (2F=48), so the published and the transformers-5 fused layouts differ in shape
    moe = dict(TEXT, head_dim=16, rope_parameters=rope, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
    return Qwen3VLMoeConfig(text_config=moe, vision_config=vision, tie_word_embeddings=False)


@torch.no_grad()
def hf_model(case: str, seed: int = 2):  # noqa: ANN201
    """``case``'s ForConditionalGeneration with random weights (norms around 1), fp32, eager attention."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(hf_config(case), dtype=torch.float32, attn_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.05 * noise)
    return model.eval()


@dataclass
class Batch:
    """Two samples of 28 tokens with images (and, for Qwen2.5-VL, a video) and the processor's M-RoPE ids."""

    input_ids: torch.Tensor  # [b, s]
    position_ids: torch.Tensor  # [3, b, s] from transformers' get_rope_index
    visual_mask: torch.Tensor  # [b, s]
    visual_embeds: torch.Tensor  # [n, d]
    deepstack: list[torch.Tensor]  # [n, d] each (Qwen3-VL cases)
    labels: torch.Tensor  # [b, s]: the next token


def batch(case: str, hf, seed: int = 3) -> Batch:  # noqa: ANN001
    """Sample 0: text, a 2x3 image (grid 1x4x6 patches), text, then a video of 2 frames of 2x2 (Qwen2.5-VL; an
    image of 2x2 for Qwen3-VL, whose videos carry timestamps), text. Sample 1: text, a 2x3 image, text, a 2x2
    image, text. Visual rows and DeepStack features are random."""
    g = torch.Generator().manual_seed(seed)
    b, s, d = 2, 28, TEXT["hidden_size"]
    ids = torch.randint(0, VIDEO_TOKEN, (b, s), generator=g)
    kinds = torch.zeros(b, s, dtype=torch.int)
    kinds[0, 5:11] = 1
    kinds[1, 8:14] = 1
    kinds[1, 16:20] = 1
    images = [[1, 4, 6], [1, 4, 6], [1, 4, 4]]
    extra = {}
    if case == "qwen2_5_vl":
        kinds[0, 14:22] = 2
        extra = dict(video_grid_thw=torch.tensor([[2, 4, 4]]), second_per_grid_ts=torch.tensor([1.5]))
    else:
        kinds[0, 14:18] = 1
        images.insert(1, [1, 4, 4])
    ids[kinds == 1], ids[kinds == 2] = IMAGE_TOKEN, VIDEO_TOKEN
    pos, _ = hf.model.get_rope_index(ids, kinds, image_grid_thw=torch.tensor(images), **extra)
    mask = kinds > 0
    n = int(mask.sum())
    vis = 0.5 * torch.randn(n, d, generator=g)
    deepstack = [0.5 * torch.randn(n, d, generator=g) for _ in range(DEEPSTACK if case != "qwen2_5_vl" else 0)]
    return Batch(ids, pos, mask, vis, deepstack, torch.roll(ids, -1, dims=1))


@torch.no_grad()
def hf_logits(hf, bt: Batch) -> torch.Tensor:  # noqa: ANN001
    """transformers' text model + lm_head on the same inputs embeddings: the text embeddings with the visual rows
    at the placeholders (what ``Qwen*VLModel.forward`` builds), DeepStack through ``visual_pos_masks``."""
    text = hf.model.language_model
    embeds = text.embed_tokens(bt.input_ids).masked_scatter(bt.visual_mask[..., None], bt.visual_embeds)
    kwargs = {}
    if bt.deepstack:
        kwargs = dict(visual_pos_masks=bt.visual_mask, deepstack_visual_embeds=bt.deepstack)
    out = text(inputs_embeds=embeds, position_ids=bt.position_ids, **kwargs)
    return hf.lm_head(out.last_hidden_state)


def build_loong(case: str, hf, layout, capabilities: set[str], parallel=None, **kw):  # noqa: ANN001, ANN201
    """The Loong foundation of ``hf``'s text model at ``parallel`` (default TP=1), fp32, weights from ``hf``."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from loong.core.config.schema import ParallelConfig
    from loong.core.engines.megatron.state import load_full_state
    from loong.llm.models.build import transformer_config
    from loong.vlm.models.foundation import build_foundation
    from loong.vlm.models.text_mapping import select_text, text_config_from_hf, text_hf_to_native

    text = text_config_from_hf(hf.config.to_dict())
    model_parallel_cuda_manual_seed(0)
    tc = transformer_config(text.model, parallel or ParallelConfig(), torch.float32, {"use_cpu_initialization": True})
    model = build_foundation(text.model, tc, capabilities, True, True, layout.pg_collection, None,
                             text.mrope_section, text.mrope_interleaved,
                             deepstack_layers=DEEPSTACK if case != "qwen2_5_vl" else 0, **kw)
    load_full_state([model], text_hf_to_native(select_text(hf.state_dict()), text.model))
    return model.eval()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max relative error of ``a`` against ``b``."""
    return ((a - b).abs().max() / b.abs().max()).item()
