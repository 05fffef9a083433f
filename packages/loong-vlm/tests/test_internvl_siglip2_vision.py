"""InternVL 3.5's and SigLIP2's vision sides against transformers' own modules, on CPU in fp32.

Oracles, built in-process from tiny configs with seeded random weights (no downloads):

- InternVL: ``InternVLModel.get_image_features`` (the vision tower, CLS dropped, pixel shuffle, the projector), on
  several tiles, in two variants (the published LayerNorm tower; an RMSNorm tower with QK norm, a final LayerNorm
  and no QKV bias). The tiles also come from ``InternVLProcessor`` (GotOcr2 image processor, ``crop_to_patches``):
  a large image becomes several tiles plus a thumbnail, and the tower gives exactly as many embeddings as the
  processor writes image tokens.
- SigLIP2: ``Siglip2VisionModel(pixel_values, pixel_attention_mask, spatial_shapes).last_hidden_state`` on the
  valid patches of two images of different aspect ratios padded into one batch by ``Siglip2ImageProcessorPil``
  (position table resized down along one axis and up along the other).
- The ``mlp`` projector has no HF model of the SigLIP2 pairing; it is checked for shapes and gradients, and against
  ``LlavaMultiModalProjector`` (LLaVA's two-layer MLP, the same function), whose names its mapping takes.

Gradients of every parameter go back through the mapping to HF's names and match HF's. Parameter counts at the
published shapes are checked on ``meta`` against HF's modules and published totals.
"""

from __future__ import annotations

import dataclasses
from importlib.resources import files

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import InternVLConfig, LlavaConfig, Qwen2Tokenizer, Siglip2VisionConfig
from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.internvl.modeling_internvl import InternVLForConditionalGeneration, InternVLModel
from transformers.models.internvl.processing_internvl import InternVLProcessor
from transformers.models.internvl.video_processing_internvl import InternVLVideoProcessor
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector
from transformers.models.siglip2.image_processing_pil_siglip2 import Siglip2ImageProcessorPil
from transformers.models.siglip2.modeling_siglip2 import Siglip2VisionModel

from loong.core.config.schema import from_dict
from loong.core.errors import LoongError
from loong.vlm.models import internvl, siglip2
from loong.vlm.models.config import EncoderConfig, ProjectorConfig
from loong.vlm.models.vision.common import EncoderOutput

TOL = 1e-5
ARCH_FIELDS = [f.name for f in dataclasses.fields(EncoderConfig)
               if f.name not in ("preset", "init_from", "recompute", "decoupled", "parallel")]

TINY_TEXT = dict(model_type="qwen3", vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=24)
#: the InternVL variants: the published structure, and every optional piece switched the other way
INTERNVL_VARIANTS = {
    "published": dict(attention_bias=True, norm_type="layer_norm", use_qk_norm=False, use_mean_pooling=True),
    "rms_qknorm": dict(attention_bias=False, norm_type="rms_norm", use_qk_norm=True, use_mean_pooling=False),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Seeded random values in every parameter (norm weights around 1, so no layer is near-degenerate)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name and name.endswith("weight") else 0.2 * noise)


def load_preset(group: str, name: str, foundation_hidden: int) -> EncoderConfig | ProjectorConfig:
    """A preset yaml of ``group`` as its dataclass, ``${foundation.hidden_size}`` resolved."""
    text = (files("loong.vlm.configs") / group / f"{name}.yaml").read_text()
    node = OmegaConf.create({"foundation": {"hidden_size": foundation_hidden}, group: OmegaConf.create(text)})
    data = OmegaConf.to_container(node, resolve=True)[group]
    return from_dict(EncoderConfig if group == "encoder" else ProjectorConfig, data, group)


def load_native(enc: torch.nn.Module, proj: torch.nn.Module | None, native: dict[str, torch.Tensor]) -> None:
    enc.load_state_dict({k[len("encoder."):]: v for k, v in native.items() if k.startswith("encoder.")}, strict=True)
    if proj is not None:
        proj.load_state_dict({k[len("projector."):]: v for k, v in native.items() if k.startswith("projector.")},
                             strict=True)


def native_grads(enc: torch.nn.Module, proj: torch.nn.Module | None) -> dict[str, torch.Tensor]:
    out = {f"encoder.{k}": p.grad for k, p in enc.named_parameters()}
    if proj is not None:
        out.update({f"projector.{k}": p.grad for k, p in proj.named_parameters()})
    return out


def assert_grads_match(hf_params: dict[str, torch.nn.Parameter], ours_as_hf: dict[str, torch.Tensor]) -> None:
    """Every HF parameter's gradient equals ours mapped to HF's names (relative error per tensor). The key bias is
    the exception: softmax ignores a shift shared by all keys, so its true gradient is 0 and both sides hold
    rounding noise only, which must be negligible against the largest gradient."""
    assert set(ours_as_hf) == set(hf_params)
    scale = max(p.grad.abs().max() for p in hf_params.values())
    for key, p in hf_params.items():
        if key.endswith("k_proj.bias"):
            assert max(p.grad.abs().max(), ours_as_hf[key].abs().max()) <= TOL * scale, key
            continue
        assert p.grad is not None and p.grad.abs().max() > 0, key
        assert rel_err(ours_as_hf[key], p.grad) <= TOL, key


# ------------------------------------------------------------------------------------------------- InternVL

def internvl_hf(variant: str, image_size: int = 56) -> InternVLModel:
    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  image_size=image_size, patch_size=14, layer_scale_init_value=0.5, **INTERNVL_VARIANTS[variant])
    cfg = InternVLConfig(vision_config=vision, text_config=TINY_TEXT, downsample_ratio=0.5)
    cfg._attn_implementation = "sdpa"
    cfg.vision_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = InternVLModel(cfg).eval()
    randomize(hf, seed=1)
    return hf


def internvl_vision_state(hf: InternVLModel) -> dict[str, torch.Tensor]:
    """The vision side of ``hf``'s state, keys relative to ``model.`` of InternVLForConditionalGeneration."""
    return {k: v for k, v in hf.state_dict().items() if not k.startswith("language_model.")}


def internvl_loong(hf: InternVLModel):
    d = hf.config.to_dict()
    enc_cfg, proj_cfg = internvl.enc_cfg_from_hf(d["vision_config"]), internvl.proj_cfg_from_hf(d)
    enc, proj = internvl.build_encoder(enc_cfg), internvl.build_projector(proj_cfg, enc_cfg)
    load_native(enc, proj, internvl.hf_to_native(internvl_vision_state(hf), enc_cfg, proj_cfg))
    return enc_cfg, proj_cfg, enc, proj


@pytest.mark.parametrize("variant", list(INTERNVL_VARIANTS))
def test_internvl_matches_hf_image_features_and_gradients(variant: str) -> None:
    hf = internvl_hf(variant)
    enc_cfg, proj_cfg, enc, proj = internvl_loong(hf)
    pixels = torch.randn(3, 3, 56, 56, generator=torch.Generator().manual_seed(2))
    hf_out = hf.get_image_features(pixel_values=pixels)
    ref = hf_out.pooler_output                       # [tiles, tokens per tile, text hidden]
    hidden = enc(pixels)
    out = proj(hidden)
    assert hidden.intermediates == [] and out.deepstack == []
    # the encoder alone: HF's last hidden state without the CLS token, tiles one after the other
    assert rel_err(hidden.hidden, hf_out.last_hidden_state[:, 1:].reshape(-1, 32)) <= TOL
    assert out.embeds.shape == (3 * internvl.tokens_per_tile(enc_cfg, proj_cfg), 48) == (12, 48)
    assert rel_err(out.embeds, ref.reshape(-1, 48)) <= TOL

    weights = torch.randn(out.embeds.shape, generator=torch.Generator().manual_seed(3))
    (ref.reshape(-1, 48) * weights).sum().backward()
    (out.embeds * weights).sum().backward()
    hf_params = {k: p for k, p in hf.named_parameters() if not k.startswith("language_model.")}
    assert_grads_match(hf_params, internvl.native_to_hf(native_grads(enc, proj), enc_cfg, proj_cfg))


@pytest.mark.parametrize("variant", list(INTERNVL_VARIANTS))
def test_internvl_hf_loong_hf_is_bit_exact(variant: str) -> None:
    hf = internvl_hf(variant)
    d = hf.config.to_dict()
    enc_cfg, proj_cfg = internvl.enc_cfg_from_hf(d["vision_config"]), internvl.proj_cfg_from_hf(d)
    state = internvl_vision_state(hf)
    back = internvl.native_to_hf(internvl.hf_to_native(state, enc_cfg, proj_cfg), enc_cfg, proj_cfg)
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    # the tower alone (proj_cfg None) maps the vision_tower keys only
    tower = {k: v for k, v in state.items() if k.startswith(internvl.HF_ENCODER_PREFIX)}
    assert set(internvl.native_to_hf(internvl.hf_to_native(tower, enc_cfg, None), enc_cfg, None)) == set(tower)
    with pytest.raises(LoongError, match="missing"):
        internvl.hf_to_native({k: v for k, v in state.items() if "layer.1.attention.k_proj" not in k},
                              enc_cfg, proj_cfg)


def tiny_internvl_processor(tile: int, image_seq_length: int) -> InternVLProcessor:
    """InternVLProcessor over the GotOcr2 image processor (the one transformers maps ``internvl`` to) and a tiny
    Qwen2 tokenizer carrying InternVL's image tokens, built in-process."""
    assert IMAGE_PROCESSOR_MAPPING_NAMES["internvl"]["pil"] == "GotOcr2ImageProcessorPil"
    vocab = {c: i for i, c in enumerate("abcdefghij Ġ")}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], extra_special_tokens={
        "start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>"})
    images = GotOcr2ImageProcessorPil(size={"height": tile, "width": tile}, max_patches=6)
    return InternVLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=InternVLVideoProcessor(),
                             image_seq_length=image_seq_length)


def test_internvl_processor_tiles_give_one_embedding_per_image_token() -> None:
    enc_cfg = load_preset("encoder", "intern_vit_tiny", 48)
    proj_cfg = load_preset("projector", "internvl_mlp_tiny", 48)
    per_tile = internvl.tokens_per_tile(enc_cfg, proj_cfg)
    processor = tiny_internvl_processor(enc_cfg.image_size, per_tile)
    rng = np.random.default_rng(0)
    wide = Image.fromarray(rng.integers(0, 255, (60, 170, 3), dtype=np.uint8))   # -> 3x1 tiles + thumbnail
    small = Image.fromarray(rng.integers(0, 255, (40, 44, 3), dtype=np.uint8))   # -> one tile, no thumbnail
    batch = processor(images=[wide, small], text=["a <IMG_CONTEXT> b <IMG_CONTEXT> c"], return_tensors="pt")
    pixels = batch["pixel_values"]
    assert tuple(pixels.shape) == (3 + 1 + 1, 3, enc_cfg.image_size, enc_cfg.image_size)
    n_image_tokens = int((batch["input_ids"] == processor.image_token_id).sum())
    assert n_image_tokens == 5 * per_tile == 20

    # the same tower in HF (from the preset's exported configs) and in Loong, on the processor's tiles
    cfg = InternVLConfig(vision_config=internvl.hf_vision_config(enc_cfg, proj_cfg), text_config=TINY_TEXT,
                         **internvl.hf_projector_config(proj_cfg, enc_cfg))
    cfg._attn_implementation = cfg.vision_config._attn_implementation = "sdpa"
    hf = InternVLModel(cfg).eval()
    randomize(hf, seed=4)
    enc, proj = internvl.build_encoder(enc_cfg), internvl.build_projector(proj_cfg, enc_cfg)
    load_native(enc, proj, internvl.hf_to_native(internvl_vision_state(hf), enc_cfg, proj_cfg))
    with torch.no_grad():
        ref = hf.get_image_features(pixel_values=pixels).pooler_output.reshape(-1, 48)
        embeds = proj(enc(pixels)).embeds
    assert embeds.shape[0] == n_image_tokens == ref.shape[0]
    assert rel_err(embeds, ref) <= TOL


def test_internvl_bad_input_is_refused() -> None:
    enc_cfg = load_preset("encoder", "intern_vit_tiny", 48)
    enc = internvl.build_encoder(enc_cfg)
    with pytest.raises(LoongError, match=r"pixel_values must be \[n_tiles, 3, 56, 56\]"):
        enc(torch.zeros(2, 3, 56, 42))
    with pytest.raises(LoongError, match="downsample_ratio"):
        internvl.build_projector(ProjectorConfig(family="internvl_mlp", out_hidden_size=48, downsample_ratio=0.4),
                                 enc_cfg)
    with pytest.raises(LoongError, match="vision_feature_layer"):
        internvl.proj_cfg_from_hf({"vision_feature_layer": -2, "text_config": {"hidden_size": 48}})


# -------------------------------------------------------------------------------------------------- SigLIP2

def siglip2_hf(use_head: bool) -> Siglip2VisionModel:
    cfg = Siglip2VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              patch_size=4, num_patches=64, vision_use_head=use_head)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = Siglip2VisionModel(cfg).eval()
    randomize(hf, seed=5)
    return hf


def siglip2_batch() -> dict[str, torch.Tensor]:
    """Two images of different aspect ratios in one padded batch: 4x10 patches (the 8x8 position table shrunk
    along rows, stretched along columns) and 6x6 (4 padding patches)."""
    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 255, (30, 95, 3), dtype=np.uint8)),
              Image.fromarray(rng.integers(0, 255, (33, 33, 3), dtype=np.uint8))]
    batch = Siglip2ImageProcessorPil(patch_size=4, max_num_patches=40)(images, return_tensors="pt")
    assert batch["spatial_shapes"].tolist() == [[4, 10], [6, 6]]
    assert batch["pixel_attention_mask"].sum(1).tolist() == [40, 36]
    return dict(batch)


def test_siglip2_matches_hf_on_a_padded_batch_and_gradients() -> None:
    hf = siglip2_hf(use_head=True)
    enc_cfg = siglip2.enc_cfg_from_hf(hf.config.to_dict())
    enc = siglip2.build_encoder(enc_cfg)
    load_native(enc, None, siglip2.hf_to_native(hf.state_dict(), enc_cfg, None))
    batch = siglip2_batch()
    mask = batch["pixel_attention_mask"].bool()
    # the processor writes each image's valid patches first: the layout the encoder reads from a padded batch
    assert torch.equal(mask, torch.arange(40)[None] < batch["spatial_shapes"].prod(-1)[:, None])
    ref = hf(**batch).last_hidden_state[mask]
    out = enc(batch["pixel_values"], batch["spatial_shapes"]).hidden
    assert out.shape == (76, 32)
    assert rel_err(out, ref) <= TOL
    packed = batch["pixel_values"][mask]
    grid_thw = torch.cat([torch.ones(2, 1, dtype=torch.long), batch["spatial_shapes"]], dim=1)
    assert torch.equal(enc(packed, grid_thw).hidden, out)

    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    (ref * weights).sum().backward()
    (out * weights).sum().backward()
    hf_params = {k: p for k, p in hf.named_parameters() if not k.startswith(siglip2.HF_DROPPED_PREFIX)}
    assert_grads_match(hf_params, siglip2.native_to_hf(native_grads(enc, None), enc_cfg, None))


def llava_projector(vision_hidden: int, text_hidden: int) -> LlavaMultiModalProjector:
    cfg = LlavaConfig(vision_config=dict(model_type="siglip2_vision_model", hidden_size=vision_hidden),
                      text_config=dict(TINY_TEXT, hidden_size=text_hidden), vision_feature_layer=-1)
    module = LlavaMultiModalProjector(cfg)
    randomize(module, seed=7)
    return module


def test_siglip2_hf_loong_hf_is_bit_exact_and_drops_the_head() -> None:
    hf = siglip2_hf(use_head=True)
    enc_cfg = siglip2.enc_cfg_from_hf(hf.config.to_dict())
    proj_cfg = ProjectorConfig(family="mlp", out_hidden_size=48)
    llava = llava_projector(32, 48)
    state = {**hf.state_dict(), **{siglip2.HF_PROJECTOR_PREFIX + k: v for k, v in llava.state_dict().items()}}
    back = siglip2.native_to_hf(siglip2.hf_to_native(state, enc_cfg, proj_cfg), enc_cfg, proj_cfg)
    headless = {k: v for k, v in state.items() if not k.startswith(siglip2.HF_DROPPED_PREFIX)}
    assert len(headless) < len(state) and set(back) == set(headless)
    assert all(torch.equal(back[k], headless[k]) for k in headless)
    with pytest.raises(LoongError, match="unexpected"):
        siglip2.hf_to_native({**state, "encoder.layers.9.mlp.fc1.weight": torch.zeros(1)}, enc_cfg, proj_cfg)


def test_mlp_projector_shapes_gradients_and_llava_form() -> None:
    """No HF model pairs SigLIP2 with this projector: shapes and gradients, plus LLaVA's identical two-layer MLP as
    the function it must compute."""
    enc_cfg = load_preset("encoder", "siglip2_tiny", 48)
    proj_cfg = load_preset("projector", "mlp", 48)
    enc, proj = siglip2.build_encoder(enc_cfg), siglip2.build_projector(proj_cfg, enc_cfg)
    grid = torch.tensor([[1, 3, 5], [1, 4, 4]])
    pixels = torch.randn(15 + 16, enc_cfg.in_channels * enc_cfg.patch_size ** 2)
    out = proj(enc(pixels, grid), grid)
    assert out.embeds.shape == (31, 48) and out.deepstack == []
    out.embeds.square().mean().backward()
    for module in (enc, proj):
        for name, p in module.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, name

    llava = llava_projector(enc_cfg.hidden_size, 48)
    native = siglip2.hf_to_native(
        {siglip2.HF_PROJECTOR_PREFIX + k: v for k, v in llava.state_dict().items()}
        | {k: v for k, v in siglip2.native_to_hf({f"encoder.{k}": v for k, v in enc.state_dict().items()},
                                                 enc_cfg, None).items()},
        enc_cfg, proj_cfg)
    load_native(enc, proj, native)
    features = torch.randn(7, enc_cfg.hidden_size)
    assert rel_err(proj(EncoderOutput(hidden=features)).embeds, llava(features)) <= TOL


def test_siglip2_bad_input_is_refused() -> None:
    enc = siglip2.build_encoder(load_preset("encoder", "siglip2_tiny", 48))
    with pytest.raises(LoongError, match="t=1"):
        enc(torch.zeros(8, 768), torch.tensor([[2, 2, 2]]))
    with pytest.raises(LoongError, match="has 9 patches"):
        enc(torch.zeros(9, 768), torch.tensor([[2, 4]]))
    with pytest.raises(LoongError, match="num_position_embeddings"):
        siglip2.build_encoder(dataclasses.replace(load_preset("encoder", "siglip2_tiny", 48),
                                                  num_position_embeddings=60))


# ---------------------------------------------------------------------------------- presets and parameter counts

#: published config values (config.json of the HF checkpoints), the HF side of the count checks
INTERNVIT_300M = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                      attention_bias=True, image_size=[448, 448], patch_size=[14, 14], hidden_act="gelu",
                      layer_norm_eps=1e-6, layer_scale_init_value=0.1, norm_type="layer_norm", use_qk_norm=False,
                      use_mean_pooling=True)
QWEN3_0_6B = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128)
QWEN3_8B = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
#: preset -> (HF text config, published total of the HF checkpoint: OpenGVLab/InternVL3_5-1B-HF stores
#: 1,060,897,792 parameters (untied lm_head); the InternVL3.5 model card gives 8.5B for InternVL3_5-8B)
INTERNVL_PUBLISHED = {"internvl3_5_1b": (QWEN3_0_6B, 1_060_897_792), "internvl3_5_8b": (QWEN3_8B, 8.5e9)}
SIGLIP2_PUBLISHED = {
    # ViT-B/16 (86M without the pooling head) and So400m/16 (the SoViT-400m shape, 428M with its head)
    "siglip2_base_patch16_naflex": (dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                         num_attention_heads=12), 86e6, False),
    "siglip2_so400m_patch16_naflex": (dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                           num_attention_heads=16), 428e6, True),
}


@pytest.mark.parametrize("preset", list(INTERNVL_PUBLISHED))
def test_internvl_presets_match_published_parameter_counts(preset: str) -> None:
    text, published = INTERNVL_PUBLISHED[preset]
    enc_cfg = load_preset("encoder", preset, text["hidden_size"])
    proj_cfg = load_preset("projector", preset, text["hidden_size"])
    from_hf = internvl.enc_cfg_from_hf(INTERNVIT_300M)
    assert {f: getattr(enc_cfg, f) for f in ARCH_FIELDS} == {f: getattr(from_hf, f) for f in ARCH_FIELDS}
    with torch.device("meta"):
        hf = InternVLForConditionalGeneration(InternVLConfig(vision_config=INTERNVIT_300M,
                                                             text_config=dict(text, tie_word_embeddings=False),
                                                             tie_word_embeddings=False))
        enc, proj = internvl.build_encoder(enc_cfg), internvl.build_projector(proj_cfg, enc_cfg)
    ours = internvl.encoder_num_parameters(enc_cfg) + internvl.projector_num_parameters(proj_cfg, enc_cfg)
    assert internvl.encoder_num_parameters(enc_cfg) == count(enc) == count(hf.model.vision_tower) == 304_012_288
    assert ours == count(enc) + count(proj) == count(hf.model.vision_tower) + count(hf.model.multi_modal_projector)
    total = count(hf)
    assert (total == published) if isinstance(published, int) else (round(total / 1e8) * 1e8 == published)


@pytest.mark.parametrize("preset", list(SIGLIP2_PUBLISHED))
def test_siglip2_presets_match_published_parameter_counts(preset: str) -> None:
    vision, published, with_head = SIGLIP2_PUBLISHED[preset]
    hf_cfg = dict(vision, patch_size=16, num_patches=256, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
    enc_cfg = load_preset("encoder", preset, 2048)
    from_hf = siglip2.enc_cfg_from_hf(hf_cfg)
    assert {f: getattr(enc_cfg, f) for f in ARCH_FIELDS} == {f: getattr(from_hf, f) for f in ARCH_FIELDS}
    with torch.device("meta"):
        hf = Siglip2VisionModel(Siglip2VisionConfig(**hf_cfg, vision_use_head=True))
        enc = siglip2.build_encoder(enc_cfg)
    assert siglip2.encoder_num_parameters(enc_cfg) == count(enc) == count(hf) - count(hf.head)
    assert round((count(hf) if with_head else count(enc)) / 1e6) * 1e6 == published


@pytest.mark.parametrize("enc_name, proj_name, fam", [
    ("intern_vit_tiny", "internvl_mlp_tiny", internvl), ("internvl3_5_1b", "internvl3_5_1b", internvl),
    ("internvl3_5_8b", "internvl3_5_8b", internvl), ("siglip2_tiny", "mlp", siglip2),
    ("siglip2_base_patch16_naflex", "mlp", siglip2), ("siglip2_so400m_patch16_naflex", "mlp", siglip2)])
def test_hf_config_round_trip(enc_name: str, proj_name: str, fam) -> None:
    """Loong -> HF config dicts -> Loong is the identity, straight and through transformers' config classes."""
    enc_cfg, proj_cfg = load_preset("encoder", enc_name, 96), load_preset("projector", proj_name, 96)
    vision = fam.hf_vision_config(enc_cfg, proj_cfg)
    composite = {**fam.hf_projector_config(proj_cfg, enc_cfg), "text_config": {"hidden_size": 96}}
    if fam is internvl:
        full = InternVLConfig(vision_config=vision, text_config=dict(TINY_TEXT, hidden_size=96),
                              **fam.hf_projector_config(proj_cfg, enc_cfg)).to_dict()
        through_hf = full["vision_config"]
        assert fam.proj_cfg_from_hf(full) == proj_cfg
    else:
        through_hf = Siglip2VisionConfig(**{k: v for k, v in vision.items() if k != "model_type"}).to_dict()
        assert through_hf["vision_use_head"] is False
    for d in (vision, through_hf):
        back = fam.enc_cfg_from_hf(d)
        assert {f: getattr(back, f) for f in ARCH_FIELDS} == {f: getattr(enc_cfg, f) for f in ARCH_FIELDS}
    assert fam.proj_cfg_from_hf(composite) == proj_cfg


def test_tiny_presets_run_with_recompute_and_count_flops() -> None:
    """The tiny presets train with activation recompute, and the analytic FLOPs equal the counted matmuls."""
    enc_cfg = dataclasses.replace(load_preset("encoder", "intern_vit_tiny", 48), recompute=True)
    proj_cfg = load_preset("projector", "internvl_mlp_tiny", 48)
    enc, proj = internvl.build_encoder(enc_cfg).train(), internvl.build_projector(proj_cfg, enc_cfg)
    proj(enc(torch.randn(2, 3, 56, 56))).embeds.sum().backward()
    assert all(p.grad is not None for p in enc.parameters())
    # the math SDPA backend runs attention as matmuls, which the counter sees
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        enc(torch.randn(3, 3, 56, 56))
    assert counter.get_total_flops() == sum(internvl.encoder_flops(enc_cfg, [2, 1]))
    s_cfg = load_preset("encoder", "siglip2_tiny", 48)
    s_enc, grid = siglip2.build_encoder(s_cfg), torch.tensor([[3, 5], [4, 4]])
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        s_enc(torch.randn(31, 768), grid)
    assert counter.get_total_flops() == sum(siglip2.encoder_flops(s_cfg, grid))
    s_enc = siglip2.build_encoder(dataclasses.replace(s_cfg, recompute=True)).train()
    s_enc(torch.randn(31, 768), grid).hidden.sum().backward()
    assert all(p.grad is not None for p in s_enc.parameters())
