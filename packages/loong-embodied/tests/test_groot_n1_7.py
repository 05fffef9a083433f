"""GR00T N1.7 against lerobot 0.6.1's GrootPolicy (fp32, CPU, tiny, offline; fixtures in groot_testing.py).

Oracle: lerobot's own ``GrootPolicy`` and ``make_groot_pre_post_processors``, built from a tiny raw base
checkpoint; Loong's policy gets the same weights through ``from_lerobot``.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from loong.core.errors import LoongError
from loong.embodied.policies.groot_n1_7 import SPEC, GrootN17Config, GrootN17Policy, GrootN17Processor
from loong.embodied.policies.groot_n1_7 import lerobot as mapping

sys.path.insert(0, str(Path(__file__).parent))
import groot_testing as gt  # noqa: E402

RTOL = 1e-5
MODEL_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw", "state",
              "action", "action_mask", "embodiment_id")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    from lerobot.policies.groot.modeling_groot import GrootPolicy
    from lerobot.policies.groot.processor_groot import make_groot_pre_post_processors

    env = gt.make_lerobot_env(tmp_path_factory.mktemp("groot17"))
    lr_config = gt.lerobot_groot_config(env)
    policy = GrootPolicy(lr_config).eval()
    pre, post = make_groot_pre_post_processors(lr_config, dataset_stats=gt.dataset_stats())
    config, state = mapping.from_lerobot(lr_config, policy.state_dict(), processor=str(env["processor_dir"]))
    ours = GrootN17Policy(config).eval()
    ours.load_state_dict(state, strict=True)
    processor = GrootN17Processor(config, stats=gt.dataset_stats(), camera_keys=gt.CAMERAS)
    return {"env": env, "lr_config": lr_config, "policy": policy, "pre": pre, "post": post, "config": config,
            "ours": ours, "processor": processor}


def lerobot_inputs(oracle, batch):
    return oracle["pre"](copy.deepcopy(batch))


@pytest.mark.parametrize("alternate", [True, False])
def test_shared_action_head_matches_lerobot(alternate):
    """The shared GR00T head (loong.embodied.policies.groot) against lerobot's GR00TN17ActionHead: 4 DiT blocks
    (text- and image-masked cross-attention both used) or the plain DiT, training mode with state dropout (the
    global-generator draws in lerobot's order), bit-for-bit loss and 4-step sample."""
    from lerobot.policies.groot.groot_n1_7 import GR00TN17ActionHead, GR00TN17Config
    from transformers.feature_extraction_utils import BatchFeature

    from loong.embodied.policies.groot import (
        ActionHeadConfig,
        DiTConfig,
        GrootActionHead,
        SelfAttentionConfig,
    )

    torch.manual_seed(0)
    ref = GR00TN17ActionHead(GR00TN17Config(
        backbone_embedding_dim=64, hidden_size=32, input_embedding_dim=32, max_state_dim=12, max_action_dim=10,
        action_horizon=6, max_seq_len=64, max_num_embodiments=4, state_dropout_prob=0.5,
        use_alternate_vl_dit=alternate,
        diffusion_model_cfg=dict(positional_embeddings=None, num_layers=4, num_attention_heads=2,
                                 attention_head_dim=16, norm_type="ada_norm", dropout=0.0, final_dropout=True,
                                 output_dim=32, interleave_self_attention=True),
        vl_self_attention_cfg=dict(positional_embeddings=None, num_layers=1, num_attention_heads=2,
                                   attention_head_dim=32, dropout=0.0, final_dropout=True))).train()
    head = GrootActionHead(ActionHeadConfig(
        max_state_dim=12, max_action_dim=10, action_horizon=6, hidden_size=32, input_embedding_dim=32,
        backbone_embedding_dim=64, num_embodiments=4, max_seq_len=64, state_dropout_prob=0.5,
        dit=DiTConfig(num_layers=4, num_attention_heads=2, attention_head_dim=16, output_dim=32,
                      cross_attention_dim=64, dropout=0.0, use_alternate_vl_dit=alternate),
        vl_self_attention=SelfAttentionConfig(num_layers=1, num_attention_heads=2, attention_head_dim=32,
                                              dropout=0.0))).train()
    assert set(head.state_dict()) == set(ref.state_dict())
    head.load_state_dict(ref.state_dict())
    b, s = 4, 9
    vl = torch.randn(b, s, 64)
    vl_mask = torch.ones(b, s, dtype=torch.bool)
    vl_mask[0, :2] = False
    image_mask = torch.zeros(b, s, dtype=torch.bool)
    image_mask[:, 2:5] = True
    state, actions = torch.randn(b, 1, 12), torch.randn(b, 6, 10)
    action_mask = torch.ones(b, 6, 10)
    action_mask[:, :, 7:] = 0
    emb = torch.tensor([0, 3, 1, 2])

    def backbone_output():
        return BatchFeature(dict(backbone_features=vl.clone(), backbone_attention_mask=vl_mask, image_mask=image_mask))

    torch.manual_seed(5)
    ref_loss = ref(backbone_output(), BatchFeature(dict(state=state, action=actions, action_mask=action_mask,
                                                        embodiment_id=emb)))["loss"]
    torch.manual_seed(5)
    loss, _ = head.loss(vl, state, actions, action_mask, emb, vl_mask=vl_mask, image_mask=image_mask)
    assert torch.equal(loss, ref_loss)
    ref.eval(), head.eval()
    torch.manual_seed(7)
    ref_actions = ref.get_action(backbone_output(), BatchFeature(dict(state=state, embodiment_id=emb)))["action_pred"]
    torch.manual_seed(7)
    assert torch.equal(head.sample(vl, state, emb, vl_mask=vl_mask, image_mask=image_mask), ref_actions)


def test_spec_and_presets():
    from loong.embodied.policies import POLICIES

    assert POLICIES.get("groot_n1_7") is SPEC
    assert set(SPEC.presets) == {"tiny", "groot_n1_7"}
    published = SPEC.presets["groot_n1_7"]
    assert (published.chunk_size, published.max_action_dim, published.num_inference_steps) == (40, 132, 4)
    assert published.dit_num_layers == 32 and published.vl_self_attention_layers == 4


def test_from_lerobot_config(oracle):
    c: GrootN17Config = oracle["config"]
    tiny = SPEC.presets["tiny"]
    for field in ("chunk_size", "max_state_dim", "max_action_dim", "select_layer", "hidden_size",
                  "input_embedding_dim", "dit_num_layers", "vl_self_attention_layers", "num_inference_steps"):
        assert getattr(c, field) == getattr(tiny, field), field
    assert c.backbone["text_config"]["hidden_size"] == 64


def test_processor_matches_lerobot(oracle):
    batch = gt.raw_batch(seed=1)
    batch["task"] = ["Pick up the red cube, then place it in the box!", "push"]  # unequal lengths: left padding
    theirs = lerobot_inputs(oracle, batch)
    ours = oracle["processor"](batch)
    assert set(MODEL_KEYS) <= set(ours)
    assert (ours["attention_mask"] == 0).any()
    for key in MODEL_KEYS:
        assert ours[key].shape == theirs[key].shape, key
        if ours[key].dtype.is_floating_point:
            torch.testing.assert_close(ours[key], theirs[key].float(), rtol=0, atol=0, msg=key)
        else:
            assert torch.equal(ours[key].long(), theirs[key].long()), key
    # the padded action steps are masked out, the padded dims too
    assert ours["action_mask"][0, -2:].sum() == 0 and ours["action_mask"][:, :, gt.ACTION_DIM:].sum() == 0


def test_loss_matches_lerobot(oracle):
    batch = gt.raw_batch(seed=2)
    inputs = lerobot_inputs(oracle, batch)
    policy, ours = oracle["policy"], oracle["ours"]
    torch.manual_seed(123)
    ref_loss, _ = policy.forward(inputs)
    # lerobot draws the noise, then the Beta time, from the global generator: draw them the same way here
    torch.manual_seed(123)
    noise = torch.randn(inputs["action"].shape)
    time = ours.action_head.sample_time(noise.shape[0])
    mine = oracle["processor"](batch)
    loss, metrics = ours.loss(mine, noise=noise, time=time)
    assert rel_err(loss, ref_loss) <= RTOL, (loss.item(), ref_loss.item())
    assert torch.isfinite(metrics["loss"])
    # and with the draws left to the policy: same seed, same order, same loss
    torch.manual_seed(123)
    loss_drawn, _ = ours.loss(mine)
    assert rel_err(loss_drawn, ref_loss) <= RTOL
    # gradients agree too (backbone and head)
    ref_loss.backward()
    loss.backward()
    theirs = dict(policy.named_parameters())
    for name, p in ours.named_parameters():
        if p.grad is None:
            continue
        q = theirs[mapping.to_lerobot_key(name)]
        assert q.grad is not None, name
        assert (p.grad - q.grad).abs().max() <= 1e-4 * q.grad.abs().max().clamp_min(1e-6), name
    policy.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)


def test_predict_action_chunk_matches_lerobot(oracle):
    batch = gt.raw_batch(seed=3)
    del batch["action"], batch["action_is_pad"]
    inputs = lerobot_inputs(oracle, batch)
    policy, ours, config = oracle["policy"], oracle["ours"], oracle["config"]
    torch.manual_seed(7)
    ref = policy.predict_action_chunk(inputs)
    torch.manual_seed(7)
    noise = torch.randn(2, config.chunk_size, config.max_action_dim)
    mine = ours.predict_action_chunk(oracle["processor"](batch, train=False), noise=noise)
    assert mine.shape == (2, config.chunk_size, config.max_action_dim)
    assert ref.shape == (2, config.chunk_size, gt.ACTION_DIM)
    assert rel_err(mine[..., : gt.ACTION_DIM], ref) <= RTOL
    # postprocess == lerobot's postprocessor (clip + min-max inverse on the real dims)
    theirs_robot = oracle["post"](ref)
    torch.testing.assert_close(oracle["processor"].postprocess(mine), theirs_robot, rtol=1e-6, atol=1e-6)


def test_state_dict_round_trip_bit_exact(oracle):
    ours, policy = oracle["ours"], oracle["policy"]
    sd = ours.state_dict()
    lr_config, lr_sd = mapping.to_lerobot(oracle["config"], sd, oracle["processor"],
                                          base_model_path=str(oracle["env"]["base_dir"]))
    ref_sd = policy.state_dict()
    assert set(lr_sd) == set(ref_sd)
    for key, value in ref_sd.items():
        assert torch.equal(lr_sd[key], value), key
    policy.load_state_dict(lr_sd, strict=True)
    assert (lr_config.chunk_size, lr_config.max_action_dim) == (oracle["config"].chunk_size,
                                                                oracle["config"].max_action_dim)
    config2, sd2 = mapping.from_lerobot(lr_config, lr_sd, processor=oracle["config"].processor)
    assert config2 == oracle["config"]
    assert set(sd2) == set(sd)
    for key, value in sd.items():
        assert torch.equal(sd2[key], value), key


def test_export_to_lerobot_folder_gives_same_loss(oracle, tmp_path):
    """write_lerobot_base + to_lerobot: lerobot builds a GrootPolicy from the written base, saves and reloads it
    (save_pretrained / from_pretrained) and gives Loong's loss on the same batch with its own preprocessor."""
    from lerobot.policies.groot.modeling_groot import GrootPolicy

    config, processor = oracle["config"], oracle["processor"]
    torch.manual_seed(11)
    ours = GrootN17Policy(config).eval()  # fresh weights, different from the oracle's
    sd = ours.state_dict()
    base = mapping.write_lerobot_base(config, sd, tmp_path / "base")
    lr_config, lr_sd = mapping.to_lerobot(config, sd, processor, base_model_path=str(base))
    exported = GrootPolicy(lr_config)
    exported.load_state_dict(lr_sd, strict=True)
    exported.save_pretrained(str(tmp_path / "export"))
    reloaded = GrootPolicy.from_pretrained(str(tmp_path / "export")).eval()
    pre, post = mapping.lerobot_processors(reloaded.config, processor)
    batch = gt.raw_batch(seed=5)
    theirs_inputs = pre(copy.deepcopy(batch))
    torch.manual_seed(3)
    ref, _ = reloaded.forward(theirs_inputs)
    torch.manual_seed(3)
    loss, _ = ours.loss(processor(batch))
    assert rel_err(loss, ref) <= RTOL
    # and back: the exported folder's weights import bit-exactly
    config2, sd2 = mapping.from_lerobot(reloaded.config, reloaded.state_dict(), processor=config.processor)
    assert config2 == config
    assert all(torch.equal(sd2[k], v) for k, v in sd.items())


def test_freezing_flags_match_lerobot(oracle):
    from lerobot.policies.groot.modeling_groot import GrootPolicy

    flags = dict(tune_llm=False, tune_visual=False, tune_projector=False, tune_diffusion_model=True,
                 tune_vlln=False)
    lr_policy = GrootPolicy(gt.lerobot_groot_config(oracle["env"], **flags))
    ours = GrootN17Policy(oracle["config"].replace(**flags))
    trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
    theirs = {mapping.from_lerobot_key(n) for n, p in lr_policy.named_parameters() if p.requires_grad}
    assert trainable == theirs - {None}
    assert trainable and all(n.startswith("action_head.model.") for n in trainable)
    ours.train()
    assert not ours.backbone.language_model.training and not ours.backbone.visual.training
    assert ours.action_head.model.training and not ours.action_head.state_encoder.training
    top = GrootN17Policy(oracle["config"].replace(tune_llm=False, tune_top_llm_layers=1))
    assert all(p.requires_grad for p in top.backbone.language_model.layers[-1].parameters())
    assert not any(p.requires_grad for p in top.backbone.language_model.layers[0].parameters())


def test_blocks_are_decoder_layers_then_dit_blocks(oracle):
    ours = oracle["ours"]
    blocks = ours.blocks()
    c = oracle["config"]
    assert len(blocks) == c.select_layer + c.dit_num_layers
    assert blocks[0] is ours.backbone.language_model.layers[0]
    assert blocks[-1] is ours.action_head.model.transformer_blocks[-1]


def test_processor_save_load_and_bad_input(oracle, tmp_path):
    processor = oracle["processor"]
    processor.save(tmp_path / "policy")
    loaded = GrootN17Processor.load(tmp_path / "policy", oracle["config"])
    batch = gt.raw_batch(seed=4)
    a, b = processor(batch), loaded(batch)
    for key in MODEL_KEYS:
        assert torch.equal(a[key], b[key]), key
    bad = dict(batch)
    del bad[gt.CAMERAS[0]]
    with pytest.raises(LoongError, match="camera"):
        processor(bad)
    with pytest.raises(LoongError, match="min and max"):
        GrootN17Processor(oracle["config"], stats={"observation.state": {"mean": [0.0]}}, camera_keys=gt.CAMERAS)
    with pytest.raises(LoongError, match="embodiment_tag"):
        GrootN17Config(embodiment_tag="robot_x")


def test_tiny_preset_trains_and_acts_with_its_shipped_processor():
    """The tiny preset alone (no lerobot, processor built in-process): a finite loss with gradients on the
    trainable parts, select_action on a processed observation, actions back in robot units."""
    config = SPEC.presets["tiny"]
    processor = GrootN17Processor(config, stats=gt.dataset_stats(), camera_keys=gt.CAMERAS)
    torch.manual_seed(0)
    policy = GrootN17Policy(config).train()
    loss, _ = policy.loss(processor(gt.raw_batch(seed=6)))
    loss.backward()
    assert torch.isfinite(loss)
    assert policy.action_head.model.proj_out_2.weight.grad.abs().sum() > 0
    assert policy.backbone.language_model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0
    policy.eval()
    obs = gt.raw_batch(seed=7)
    del obs["action"], obs["action_is_pad"]
    action = policy.select_action(processor(obs, train=False))
    assert action.shape == (2, config.max_action_dim)
    robot = processor.postprocess(action)
    lo, hi = gt.dataset_stats()["action"]["min"], gt.dataset_stats()["action"]["max"]
    assert robot.shape == (2, gt.ACTION_DIM) and bool(((robot >= lo - 1e-6) & (robot <= hi + 1e-6)).all())


def test_published_parameter_count():
    """The groot_n1_7 preset has lerobot's GR00T N1.7 (Cosmos-Reason2-2B truncated at 16 layers) count: 3.14 B."""
    from lerobot.policies.groot.groot_n1_7 import GR00TN17, GR00TN17Config

    with torch.device("meta"):
        ours = GrootN17Policy(SPEC.presets["groot_n1_7"])
        theirs = GR00TN17(GR00TN17Config(), load_backbone_weights=False)
    n_ours = sum(p.numel() for p in ours.parameters())
    assert n_ours == sum(p.numel() for p in theirs.parameters())
    assert n_ours == 3_144_016_000  # "GR00T-N1.7-3B"
