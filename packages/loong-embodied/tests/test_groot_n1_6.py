"""GR00T N1.6 against its oracles (CPU, fp32, tiny random configs, no downloads).

- vision: transformers ``Siglip2VisionModel`` (patches by transformers' SigLIP2 processor function, position
  embeddings resized by ``F.interpolate`` as Eagle's fork does), then ``F.pixel_unshuffle`` + the connector;
- language: a deeper transformers ``Qwen3Model`` cut at ``hidden_states[select_layer]`` + its final norm;
- action head: lerobot 0.6.1's ``AlternateVLDiT`` and ``GR00TN17ActionHead`` configured as N1.6 (no VL
  self-attention, no state dropout), fed the same backbone features, noise and time;
- checkpoint: bit-exact round trip, and a synthetic published-layout folder (keys listed in groot16_testing).
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from loong.core.errors import LoongError
from loong.embodied.policies.groot_n1_6 import SPEC, GrootN16Policy, GrootN16Processor
from loong.embodied.policies.groot_n1_6 import checkpoint as ckpt
from loong.embodied.policies.groot_n1_6.config import GROOT_N1_6, GrootN16Config
from loong.embodied.policies.groot_n1_6.eagle import text_config, vision_config
from loong.embodied.policies.groot_n1_6.processor import eagle_prompt

sys.path.insert(0, str(Path(__file__).parent))
from groot16_testing import (  # noqa: E402
    ACTION_DIM,
    CAMERA,
    features,
    published_keys,
    published_parameter_count,
    raw_batch,
    stats,
    tiny_config,
)

RTOL = 1e-5


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.fixture(scope="module")
def config() -> GrootN16Config:
    return tiny_config()


@pytest.fixture(scope="module")
def policy(config: GrootN16Config) -> GrootN16Policy:
    torch.manual_seed(0)
    p = GrootN16Policy(config)
    # non-trivial LayerNorm / RMSNorm / bias values, so a swapped or skipped one shows
    with torch.no_grad():
        for name, param in p.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "layer_norm1.weight", "layer_norm2.weight",
                              "mlp1.0.weight", "vlln.weight")):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias") or name.endswith(".b"):
                param.normal_(0.0, 0.1)
    return p.eval()


@pytest.fixture(scope="module")
def processor(config: GrootN16Config) -> GrootN16Processor:
    return GrootN16Processor(config, features=features(), stats=stats(), camera_keys=[CAMERA, "observation.images.wrist"])


@pytest.fixture(scope="module")
def inputs(processor: GrootN16Processor, config: GrootN16Config) -> dict[str, torch.Tensor]:
    return processor(raw_batch(config.chunk_size))


# --- backbone ------------------------------------------------------------------------------------------------
def reference_image_features(policy: GrootN16Policy, images: torch.Tensor) -> torch.Tensor:
    """Eagle's ``extract_feature`` written with transformers' SigLIP2 and torch's pixel_unshuffle."""
    from transformers import Siglip2VisionModel
    from transformers.models.siglip2.image_processing_siglip2 import convert_image_to_patches

    c = policy.config
    ref = Siglip2VisionModel(vision_config(c)).eval()
    ref.load_state_dict(policy.backbone.vision_model.state_dict(), strict=True)
    n, _, h, w = images.shape
    gh, gw = h // c.patch_size, w // c.patch_size
    patches = torch.stack([convert_image_to_patches(img, c.patch_size) for img in images])
    hidden = ref(pixel_values=patches, pixel_attention_mask=torch.ones(n, gh * gw, dtype=torch.long),
                 spatial_shapes=torch.tensor([[gh, gw]] * n)).last_hidden_state
    grid = hidden.transpose(1, 2).reshape(n, -1, gh, gw)
    shuffled = F.pixel_unshuffle(grid, c.pixel_shuffle).flatten(2).transpose(1, 2)
    mlp = torch.nn.Sequential(torch.nn.LayerNorm(shuffled.shape[-1]), torch.nn.Linear(shuffled.shape[-1], c.text_hidden_size),
                              torch.nn.GELU(), torch.nn.Linear(c.text_hidden_size, c.text_hidden_size))
    mlp.load_state_dict(policy.backbone.mlp1.state_dict(), strict=True)
    return mlp(shuffled)


def test_vision_path_matches_transformers_siglip2(policy: GrootN16Policy) -> None:
    torch.manual_seed(1)
    images = torch.rand(3, 3, *policy.config.image_size) * 2 - 1
    with torch.no_grad():
        ours = policy.backbone.image_features(images)
        ref = reference_image_features(policy, images)
    assert ours.shape == (3, policy.config.tokens_per_image, policy.config.text_hidden_size)
    assert max_rel_err(ours, ref) <= RTOL


def test_position_embeddings_resize_as_eagle_interpolates(policy: GrootN16Policy) -> None:
    """A grid other than the 4x4 position table: the embeddings equal Eagle's F.interpolate(bilinear, antialias)
    resize of the table plus the patch embedding (Eagle-Block2A-2B-v2 modeling_siglip2.py)."""
    from loong.embodied.policies.groot_n1_6.eagle import patchify

    c = policy.config
    emb = policy.backbone.vision_model.embeddings
    torch.manual_seed(2)
    for gh, gw in ((4, 4), (2, 6), (6, 3)):
        images = torch.rand(2, 3, gh * c.patch_size, gw * c.patch_size)
        patches = patchify(images, c.patch_size)
        with torch.no_grad():
            ours = emb(patches, torch.tensor([[gh, gw]] * 2))
            side = int(c.vision_num_patches ** 0.5)
            table = emb.position_embedding.weight.reshape(side, side, -1).permute(2, 0, 1)[None]
            pos = F.interpolate(table, size=(gh, gw), mode="bilinear", align_corners=False, antialias=True)
            ref = emb.patch_embedding(patches) + pos.reshape(-1, gh * gw).T[None]
        assert max_rel_err(ours, ref) <= RTOL, (gh, gw)


def test_language_path_matches_truncated_qwen3(policy: GrootN16Policy, inputs: dict) -> None:
    from transformers import Qwen3Model

    c = policy.config
    deeper = text_config(c.replace(select_layer=c.text_num_layers))  # the full LM; GR00T keeps select_layer
    assert c.text_num_layers > c.select_layer
    ref = Qwen3Model(deeper).eval()
    missing, unexpected = ref.load_state_dict(policy.backbone.language_model.state_dict(), strict=False)
    assert not unexpected and all(k.startswith(f"layers.{c.select_layer}.") for k in missing) and missing
    ids, mask, pixels = inputs["input_ids"], inputs["attention_mask"], inputs["pixel_values"]
    with torch.no_grad():
        vit = reference_image_features(policy, pixels.flatten(0, 1))
        embeds = ref.embed_tokens(ids).clone()
        image = ids == c.image_token_id
        embeds[image] = vit.reshape(-1, c.text_hidden_size)
        hidden = ref(inputs_embeds=embeds, attention_mask=mask, output_hidden_states=True).hidden_states
        expected = ref.norm(hidden[c.select_layer])
        ours = policy.backbone(ids, mask, pixels)
    valid = mask.bool()
    assert torch.isfinite(ours[valid]).all()
    assert max_rel_err(ours[valid], expected[valid]) <= RTOL
    # the image features reach the LM: changing a pixel changes the VL tokens
    with torch.no_grad():
        other = policy.backbone(ids, mask, pixels.flip(-1))
    assert (other[valid] - ours[valid]).abs().max() > 1e-4


# --- action head ---------------------------------------------------------------------------------------------
def lerobot_head(policy: GrootN16Policy):
    """lerobot 0.6.1's GR00T action head configured as N1.6, loaded with our head's weights."""
    from lerobot.policies.groot.groot_n1_7 import GR00TN17ActionHead, GR00TN17Config

    c = policy.config
    cfg = GR00TN17Config(
        max_state_dim=c.max_state_dim, max_action_dim=c.max_action_dim, action_horizon=c.chunk_size,
        hidden_size=c.hidden_size, input_embedding_dim=c.input_embedding_dim, state_history_length=1,
        backbone_embedding_dim=c.backbone_embedding_dim, add_pos_embed=True, use_vlln=True, max_seq_len=c.max_seq_len,
        use_alternate_vl_dit=True, attend_text_every_n_blocks=c.attend_text_every_n_blocks,
        diffusion_model_cfg={"positional_embeddings": None, "num_layers": c.dit_num_layers,
                             "num_attention_heads": c.dit_num_heads, "attention_head_dim": c.dit_head_dim,
                             "norm_type": "ada_norm", "dropout": c.dit_dropout, "final_dropout": True,
                             "output_dim": c.hidden_size, "interleave_self_attention": True},
        vl_self_attention_cfg={"num_layers": 0}, num_inference_timesteps=c.num_inference_steps,
        noise_beta_alpha=c.noise_beta_alpha, noise_beta_beta=c.noise_beta_beta, noise_s=c.noise_s,
        num_timestep_buckets=c.num_timestep_buckets, state_dropout_prob=0.0, max_num_embodiments=c.num_embodiments,
        tune_projector=True, tune_diffusion_model=True, tune_vlln=True)
    head = GR00TN17ActionHead(cfg)
    head.load_state_dict(policy.action_head.state_dict(), strict=True)
    return head.eval()


@pytest.fixture(scope="module")
def reference_head(policy: GrootN16Policy):
    return lerobot_head(policy)


def backbone_output(policy: GrootN16Policy, inputs: dict):
    from transformers.feature_extraction_utils import BatchFeature

    with torch.no_grad():
        tokens = policy.backbone(inputs["input_ids"], inputs["attention_mask"], inputs["pixel_values"])
    return BatchFeature(data={"backbone_features": tokens, "backbone_attention_mask": inputs["attention_mask"].bool(),
                              "image_mask": inputs["input_ids"] == policy.config.image_token_id})


def action_input(inputs: dict):
    from transformers.feature_extraction_utils import BatchFeature

    return BatchFeature(data={"state": inputs["state"][:, None], "action": inputs["action"],
                              "action_mask": inputs["action_mask"], "embodiment_id": inputs["embodiment_id"]})


def test_dit_matches_lerobot_alternate_vl_dit(policy: GrootN16Policy, reference_head, inputs: dict) -> None:
    c = policy.config
    ours_dit, ref_dit = policy.action_head.model, reference_head.model
    assert type(ref_dit).__name__ == "AlternateVLDiT"
    bo = backbone_output(policy, inputs)
    torch.manual_seed(3)
    x = torch.randn(2, 1 + c.chunk_size, c.input_embedding_dim)
    t = torch.tensor([17, 901])
    with torch.no_grad():
        vl = reference_head.vlln(bo["backbone_features"])
        ref = ref_dit(hidden_states=x, encoder_hidden_states=vl, timestep=t, image_mask=bo["image_mask"],
                      backbone_attention_mask=bo["backbone_attention_mask"])
        ours = ours_dit(x, vl, t, vl_mask=bo["backbone_attention_mask"], image_mask=bo["image_mask"])
    assert max_rel_err(ours, ref) <= RTOL


def test_policy_loss_matches_lerobot_head_on_eagle_features(policy: GrootN16Policy, reference_head,
                                                           inputs: dict) -> None:
    for seed in (4, 5):
        # lerobot's head writes vlln(features) back into its input, so each call gets a fresh one
        bo, ai = backbone_output(policy, inputs), action_input(inputs)
        torch.manual_seed(seed)
        with torch.no_grad():
            ref = reference_head(bo, ai)["loss"]
        torch.manual_seed(seed)  # the same draws: noise, then time (no state dropout)
        with torch.no_grad():
            ours, metrics = policy.loss(inputs)
        assert max_rel_err(ours, ref) <= RTOL
        assert torch.isfinite(metrics["loss"])
    # explicit noise/time give the same loss as the draws they replace
    torch.manual_seed(6)
    noise = torch.randn(inputs["action"].shape)
    time = policy.action_head.sample_time(noise.shape[0])
    torch.manual_seed(6)
    with torch.no_grad():
        drawn, _ = policy.loss(inputs)
        fixed, _ = policy.loss(inputs, noise=noise, time=time)
    assert torch.equal(drawn, fixed)


def test_predict_action_chunk_matches_lerobot_get_action(policy: GrootN16Policy, reference_head,
                                                         inputs: dict) -> None:
    bo = backbone_output(policy, inputs)
    from transformers.feature_extraction_utils import BatchFeature

    ai = BatchFeature(data={"state": inputs["state"][:, None], "embodiment_id": inputs["embodiment_id"]})
    torch.manual_seed(7)
    with torch.no_grad():
        ref = reference_head.get_action(bo, ai)["action_pred"]
    torch.manual_seed(7)
    ours = policy.predict_action_chunk(inputs)
    c = policy.config
    assert ours.shape == (2, c.chunk_size, c.max_action_dim)
    assert max_rel_err(ours, ref) <= RTOL
    torch.manual_seed(7)
    noise = torch.randn(ours.shape)
    assert torch.equal(policy.predict_action_chunk(inputs, noise=noise), ours)


def test_loss_trains_end_to_end(config: GrootN16Config, inputs: dict) -> None:
    """Gradients reach what is trainable (top LM layer, head) and nothing frozen holds one."""
    torch.manual_seed(8)
    p = GrootN16Policy(config.replace(tune_visual=True)).train()
    loss, _ = p(inputs)  # the engine calls the module (forward = loss)
    loss.backward()
    assert p.backbone.mlp1[1].weight.grad is not None
    assert p.backbone.vision_model.encoder.layers[0].self_attn.q_proj.weight.grad is not None
    assert p.backbone.language_model.layers[-1].mlp.up_proj.weight.grad is not None
    assert all(q.grad is None for q in p.backbone.language_model.layers[0].parameters())
    assert p.action_head.model.transformer_blocks[0].attn1.to_k.weight.grad is not None


# --- freezing and presets ------------------------------------------------------------------------------------
def test_freezing_flags_are_requires_grad(config: GrootN16Config) -> None:
    p = GrootN16Policy(config)  # tune_llm=False, tune_visual=False, tune_top_llm_layers=1
    trainable = {n for n, q in p.named_parameters() if q.requires_grad}
    top = f"backbone.language_model.layers.{config.select_layer - 1}."
    assert {n for n in trainable if n.startswith("backbone.")} == {
        n for n, _ in p.named_parameters() if n.startswith(top)}
    assert all(n in trainable for n, _ in p.named_parameters() if n.startswith("action_head."))
    frozen_head = GrootN16Policy(config.replace(tune_diffusion_model=False, tune_projector=False, tune_llm=True,
                                                tune_top_llm_layers=0))
    names = {n for n, q in frozen_head.named_parameters() if q.requires_grad}
    assert "action_head.vlln.weight" in names and "backbone.language_model.embed_tokens.weight" in names
    assert not any(n.startswith(("action_head.model.", "action_head.state_encoder.", "action_head.action_encoder.",
                                 "action_head.position_embedding")) for n in names)
    assert not any(n.startswith(("backbone.vision_model.", "backbone.mlp1.")) for n in names)


def test_published_preset_parameter_count() -> None:
    """The groot_n1_6 preset on the meta device has the parameters the published layout implies; with the two
    unused heads, 2 bytes each, that is the published folder's 6.57 GB (model-0000{1,2}-of-00002: 4.99 + 1.58 GB)."""
    with torch.device("meta"):
        p = GrootN16Policy(GROOT_N1_6)
    ours = sum(q.numel() for q in p.parameters())
    assert ours == published_parameter_count(GROOT_N1_6, with_unused=False) == 2_960_729_840
    stored = published_parameter_count(GROOT_N1_6, with_unused=True)
    assert abs(stored * 2 / 6.57e9 - 1) < 0.001
    trainable = sum(q.numel() for q in p.parameters() if q.requires_grad)
    assert trainable == 1_418_624_000 + 4 * 50_336_000  # the head + the top 4 Qwen3 layers


def test_spec_and_presets() -> None:
    from loong.embodied.policies import POLICIES

    assert POLICIES.get("groot_n1_6") is SPEC
    assert set(SPEC.presets) == {"tiny", "groot_n1_6"}
    assert SPEC.lerobot is None
    g = SPEC.presets["groot_n1_6"]
    assert (g.select_layer, g.tune_top_llm_layers, g.dit_num_layers, g.chunk_size, g.max_action_dim) == (16, 4, 32, 50, 128)
    with pytest.raises(LoongError, match="select_layer"):
        GrootN16Config(select_layer=29)
    with pytest.raises(LoongError, match="image_size"):
        GrootN16Config(image_size=(250, 252))
    with pytest.raises(LoongError, match="embodiment"):
        GrootN16Config(embodiment="robot_x")


# --- processor -------------------------------------------------------------------------------------------------
def test_processor_prompt_images_state_action(processor: GrootN16Processor, inputs: dict,
                                              config: GrootN16Config) -> None:
    ids = inputs["input_ids"]
    assert ids.shape == (2, config.tokenizer_max_length)
    assert ((ids == config.image_token_id).sum(1) == 2 * config.tokens_per_image).all()
    mask = inputs["attention_mask"]
    assert mask[:, -1].all() and not mask[:, 0].any()  # left padding
    tokens = processor.tokenizer.convert_ids_to_tokens(ids[0][mask[0].bool()].tolist())
    assert tokens[:2] == ["<|im_start|>", "system"] and tokens[-1] == "<|im_end|>"
    text = eagle_prompt("reach the red target", 2, config.tokens_per_image)
    assert processor.tokenizer(text, add_special_tokens=False)["input_ids"] == ids[0][mask[0].bool()].tolist()
    assert "<unk>" not in tokens  # the instruction was lower-cased and stripped of punctuation
    px = inputs["pixel_values"]
    assert px.shape == (2, 2, 3, *config.image_size) and px.min() >= -1 and px.max() <= 1
    raw = raw_batch(config.chunk_size)
    st = inputs["state"]
    assert st.shape == (2, config.max_state_dim) and (st[:, 3:] == 0).all() and (st[:, 2] == 0).all()
    expected0 = (2 * (raw["observation.state"][:, 0] + 1) / 2 - 1).clamp(-1, 1)
    assert torch.allclose(st[:, 0], expected0)
    am = inputs["action_mask"]
    assert am[0, -1].sum() == 0 and am[1, -1, :ACTION_DIM].all() and am[..., ACTION_DIM:].sum() == 0
    assert (inputs["embodiment_id"] == 10).all()
    back = processor.postprocess(inputs["action"])
    assert torch.allclose(back, raw["action"].clamp(torch.tensor([-2.0, 0.0]), torch.tensor([2.0, 1.0])), atol=1e-6)
    infer = processor({k: v for k, v in raw.items() if k not in ("action", "action_is_pad")}
                      | {"embodiment_id": torch.tensor([1, 2])}, train=False)
    assert "action" not in infer and infer["embodiment_id"].tolist() == [1, 2]


def test_processor_save_load_and_errors(processor: GrootN16Processor, config: GrootN16Config, tmp_path) -> None:
    processor.save(tmp_path)
    again = GrootN16Processor.load(tmp_path, config)
    assert pickle.loads(pickle.dumps(processor)).tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>") == 5  # workers
    raw = raw_batch(config.chunk_size, seed=3)
    a, b = processor(raw), again(raw)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(LoongError, match="min"):
        GrootN16Processor(config, features=features(), stats={"observation.state": {"mean": [0, 0, 0]}},
                          camera_keys=[CAMERA])
    short = GrootN16Processor(config.replace(tokenizer_max_length=20), features=features(), stats=stats(),
                              camera_keys=[CAMERA])
    with pytest.raises(LoongError, match="tokenizer_max_length"):
        short(raw)
    with pytest.raises(LoongError, match="image_token_id"):
        GrootN16Processor(config.replace(image_token_id=7), features=features(), stats=stats(), camera_keys=[CAMERA])


# --- checkpoint ------------------------------------------------------------------------------------------------
def test_published_names_match_published_layout(config: GrootN16Config) -> None:
    for cfg in (config, config.replace(state_dropout_prob=0.1)):
        p = GrootN16Policy(cfg)
        ours = {ckpt.to_published_name(n): tuple(t.shape) for n, t in p.state_dict().items()}
        listed = published_keys(cfg)
        unused = {k: v for k, v in listed.items() if k.startswith(ckpt.UNUSED_PUBLISHED_PREFIXES)}
        assert set(unused) and ours == {k: v for k, v in listed.items() if k not in unused}
        assert all(ckpt.from_published_name(k) is None for k in unused)
        assert all(ckpt.from_published_name(ckpt.to_published_name(n)) == n for n in p.state_dict())


def test_checkpoint_round_trip_is_bit_exact(policy: GrootN16Policy, config: GrootN16Config, tmp_path) -> None:
    for name, shard in (("single", None), ("sharded", 40_000)):
        folder = ckpt.save_published(policy, config, tmp_path / name, max_shard_bytes=shard)
        if shard:
            index = json.loads((folder / ckpt.INDEX_FILE).read_text())
            assert len(set(index["weight_map"].values())) > 1
        loaded_config = ckpt.read_published_config(folder)
        assert loaded_config == config
        fresh = GrootN16Policy(loaded_config)
        assert ckpt.load_published(fresh, folder) == []
        a, b = policy.state_dict(), fresh.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    meta = json.loads((tmp_path / "single" / ckpt.CONFIG_FILE).read_text())
    assert meta["model_type"] == "Gr00tN1d6" and meta["select_layer"] == config.select_layer
    assert meta["diffusion_model_cfg"]["num_layers"] == config.dit_num_layers


def test_synthetic_published_folder_loads(config: GrootN16Config, tmp_path) -> None:
    """A folder written as Isaac-GR00T would (published key names incl. lm_head and the pooling head, bf16,
    two shards, a Gr00tN1d6 config.json without Loong's block) loads, every value where the published name says."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(9)
    tensors = {k: torch.randn(shape, generator=g).to(torch.bfloat16) for k, shape in published_keys(config).items()}
    keys = sorted(tensors)
    halves = (keys[: len(keys) // 2], keys[len(keys) // 2:])
    weight_map = {}
    for i, part in enumerate(halves, start=1):
        name = f"model-{i:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(tmp_path / name))
        weight_map.update(dict.fromkeys(part, name))
    (tmp_path / ckpt.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    published = {k: v for k, v in ckpt.published_config(config).items() if k != "loong"}
    (tmp_path / ckpt.CONFIG_FILE).write_text(json.dumps(published))
    cfg = ckpt.read_published_config(tmp_path, base=config)
    assert (cfg.select_layer, cfg.dit_num_layers, cfg.chunk_size) == (config.select_layer, config.dit_num_layers,
                                                                      config.chunk_size)
    p = GrootN16Policy(cfg)
    skipped = ckpt.load_published(p, tmp_path)
    assert sorted(skipped) == sorted(k for k in keys if k.startswith(ckpt.UNUSED_PUBLISHED_PREFIXES))

    def same(param: torch.Tensor, key: str) -> bool:
        return torch.equal(param, tensors[key].float())

    b = p.backbone
    assert same(b.vision_model.encoder.layers[1].mlp.fc2.weight,
                "backbone.model.vision_model.vision_model.encoder.layers.1.mlp.fc2.weight")
    assert same(b.vision_model.embeddings.position_embedding.weight,
                "backbone.model.vision_model.vision_model.embeddings.position_embedding.weight")
    assert same(b.mlp1[3].bias, "backbone.model.mlp1.3.bias")
    assert same(b.language_model.layers[1].self_attn.k_norm.weight,
                "backbone.model.language_model.model.layers.1.self_attn.k_norm.weight")
    assert same(b.language_model.norm.weight, "backbone.model.language_model.model.norm.weight")
    assert same(p.action_head.model.transformer_blocks[2].attn1.to_v.weight,
                "action_head.model.transformer_blocks.2.attn1.to_v.weight")
    assert same(p.action_head.action_encoder.W2.W, "action_head.action_encoder.W2.W")
    # a checkpoint with an LM layer above select_layer does not fit
    extra = dict(tensors)
    extra["backbone.model.language_model.model.layers.9.mlp.up_proj.weight"] = torch.zeros(1)
    save_file(extra, str(tmp_path / "bad.safetensors"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad.safetensors").rename(tmp_path / "bad" / ckpt.WEIGHTS_FILE)
    with pytest.raises(LoongError, match="unexpected"):
        ckpt.load_published(GrootN16Policy(cfg), tmp_path / "bad")
    with pytest.raises(LoongError, match="unknown published key"):
        ckpt.from_published({"backbone.model.other.weight": torch.zeros(1)})


@pytest.mark.gpu
def test_published_shape_trains_and_samples_on_gpu() -> None:
    """The groot_n1_6 preset (random weights, bf16) on one GPU: a loss with gradients where the published recipe
    trains (head + top 4 LM layers) and an action chunk; two 252x252 cameras, a 300-token prompt."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cfg = GROOT_N1_6
    torch.manual_seed(0)
    with torch.device("cuda"):
        p = GrootN16Policy(cfg).to(torch.bfloat16).train()
    b, s, cams = 2, 300, 2
    ids = torch.full((b, s), 100, dtype=torch.long)
    ids[:, 20: 20 + cams * cfg.tokens_per_image] = cfg.image_token_id
    inputs = {"input_ids": ids, "attention_mask": torch.ones(b, s, dtype=torch.long),
              "pixel_values": torch.rand(b, cams, 3, *cfg.image_size) * 2 - 1,
              "state": torch.rand(b, cfg.max_state_dim), "embodiment_id": torch.tensor([10, 2]),
              "action": torch.rand(b, cfg.chunk_size, cfg.max_action_dim) * 2 - 1,
              "action_mask": torch.ones(b, cfg.chunk_size, cfg.max_action_dim)}
    inputs = {k: (v.cuda().to(torch.bfloat16) if v.is_floating_point() else v.cuda()) for k, v in inputs.items()}
    loss, _ = p.loss(inputs)
    loss.backward()
    assert torch.isfinite(loss)
    assert p.backbone.language_model.layers[-1].mlp.down_proj.weight.grad is not None
    assert p.backbone.language_model.layers[0].mlp.down_proj.weight.grad is None
    assert p.action_head.model.transformer_blocks[31].ff.net[2].weight.grad is not None
    chunk = p.eval().predict_action_chunk(inputs)
    assert chunk.shape == (b, cfg.chunk_size, cfg.max_action_dim) and torch.isfinite(chunk).all()
