"""Pi0.5: the tiny preset trains, the processor matches lerobot's, and the model matches lerobot 0.6.1's PI05Policy.

The oracle is lerobot's own ``PI05Policy`` shrunk by the test-only patches of ``pi05_testing`` (fp32, CPU): the
same weights (moved over by ``from_lerobot``), batch, noise and time give the same loss and the same
``predict_action_chunk`` output, max relative error <= 1e-5.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from loong.core.errors import LoongError
from loong.embodied.policies import POLICIES
from loong.embodied.policies.pi05 import Pi05Config, Pi05Policy, Pi05Processor
from loong.embodied.policies.pi05 import lerobot as mapping
from loong.embodied.policies.pi05.config import lerobot_parameter_count

sys.path.insert(0, str(Path(__file__).parent))  # the shared fixtures module beside this file
import pi05_testing as pt  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """lerobot's shrunk PI05Policy, its preprocessor, and the Loong policy/processor with its weights."""
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy
    from lerobot.policies.pi05.processor_pi05 import make_pi05_pre_post_processors

    with pt.lerobot_patches(tmp_path_factory.mktemp("hub")):
        torch.manual_seed(0)
        lr_config = pt.lerobot_config()
        policy = PI05Policy(lr_config).eval()
        # lerobot zero-initialises the adaRMSNorm weights; randomise them so the time conditioning is exercised
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if ".dense." in name or name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                    p.normal_(0, 0.1)
        pre, post = make_pi05_pre_post_processors(lr_config, dataset_stats=pt.stats())
        config, state_dict = mapping.from_lerobot(lr_config, policy.state_dict(),
                                                  vision_num_heads=pt.TINY_VISION["num_attention_heads"],
                                                  tokenizer="builtin:tiny")
        loong = Pi05Policy(config).eval()
        loong.load_state_dict(state_dict, strict=True)
        processor = Pi05Processor(config, features=pt.features(), stats=pt.stats(), camera_keys=pt.CAMERAS)
        yield {"policy": policy, "pre": pre, "post": post, "loong": loong, "processor": processor,
               "lr_config": lr_config, "config": config}


def test_tiny_preset_trains():
    spec = POLICIES.get("pi05")
    config = spec.presets["tiny"]
    torch.manual_seed(0)
    policy = spec.policy_class(config)
    processor = spec.processor_class(config, features=pt.features(), stats=pt.stats(), camera_keys=pt.CAMERAS)
    raw = pt.raw_batch(4)
    raw["action"] = torch.cat([raw["action"], raw["action"]], dim=1)  # the tiny preset's chunk of 8
    raw["action_is_pad"] = torch.cat([raw["action_is_pad"]] * 2, dim=1)
    inputs = processor(raw)
    noise = torch.randn(4, config.chunk_size, config.max_action_dim)
    time = torch.full((4,), 0.5)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    first = None
    for _ in range(15):
        loss, metrics = policy.loss(inputs, noise=noise, time=time)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first
    chunk = policy.predict_action_chunk(processor(raw, train=False))
    assert chunk.shape == (4, config.chunk_size, config.max_action_dim)
    assert processor.postprocess(chunk).shape == (4, config.chunk_size, pt.ACTION_DIM)
    assert policy.select_action(processor(raw, train=False)).shape == (4, config.max_action_dim)


def test_published_parameter_count():
    config = POLICIES.get("pi05").presets["pi05"]
    with torch.device("meta"):
        policy = Pi05Policy(config)
    count = sum(p.numel() for p in policy.parameters())
    # lerobot 0.6.1 PI05Policy(PI05Config()) measured 4,143,404,816, which holds two unused LM heads
    assert lerobot_parameter_count(config, count) == 4_143_404_816
    assert count == 3_353_433_872
    assert len(policy.blocks()) == 27 + 18


def test_published_preset_maps_onto_lerobots_published_module():
    """lerobot's own PI05 module at its defaults, built on the meta device: every name and shape of the exported
    state dict is one of its, and its parameter count is the one Loong's count accounts for."""
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Pytorch

    config = POLICIES.get("pi05").presets["pi05"]
    with torch.device("meta"):
        theirs = PI05Pytorch(PI05Config(device="cpu"))
        ours = Pi05Policy(config)
    lr_config, exported = mapping.to_lerobot(config, ours.state_dict())
    assert (lr_config.paligemma_variant, lr_config.action_expert_variant) == ("gemma_2b", "gemma_300m")
    expected = {f"model.{k}": tuple(v.shape) for k, v in theirs.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in exported.items()} == expected
    count = sum(p.numel() for p in theirs.parameters())
    assert count == 4_143_404_816  # as measured by the research notes
    assert lerobot_parameter_count(config, sum(p.numel() for p in ours.parameters())) == count


def test_freezing_leaves_no_trainable_parameters_in_frozen_parts():
    base = POLICIES.get("pi05").presets["tiny"]
    policy = Pi05Policy(base.replace(tune_visual=False))
    dead = {id(p) for p in policy.dead_parameters()}
    assert not any(p.requires_grad for p in policy.vision_tower.parameters())
    assert all(p.requires_grad for p in policy.projector.parameters())
    assert all(p.requires_grad for p in policy.language_model_parameters() if id(p) not in dead)
    policy = Pi05Policy(base.replace(tune_llm=False))
    assert not any(p.requires_grad for p in policy.language_model_parameters())
    assert all(p.requires_grad for p in policy.vision_tower.parameters())
    policy = Pi05Policy(base.replace(tune_llm=False, tune_visual=False))
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(n.split(".")[0] in {"layers", "expert_norm", "action_in_proj", "action_out_proj",
                                                  "time_mlp_in", "time_mlp_out"} for n in trainable)
    assert all(".expert." in n for n in trainable if n.startswith("layers."))
    loss, _ = policy.loss(Pi05Processor(policy.config, features=pt.features(), stats=pt.stats(),
                                        camera_keys=pt.CAMERAS)(_tiny_raw()))
    loss.backward()
    assert all(p.grad is None for p in policy.parameters() if not p.requires_grad)


def test_every_trainable_parameter_gets_a_gradient_and_dead_ones_are_frozen():
    """DDP without find_unused_parameters needs a gradient for every trainable parameter; the parameters no
    output reads (the VLM's final norm, its top layer's prefix path) are frozen instead."""
    config = POLICIES.get("pi05").presets["tiny"]
    policy = Pi05Policy(config)
    dead = policy.dead_parameters()
    assert dead and not any(p.requires_grad for p in dead)
    assert len(dead) == 1 + 2 + 1 + 3  # vlm_norm; q/o proj; post-attention norm; gate/up/down
    loss, _ = policy.loss(Pi05Processor(config, features=pt.features(), stats=pt.stats(),
                                        camera_keys=pt.CAMERAS)(_tiny_raw()))
    loss.backward()
    missing = [n for n, p in policy.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing


def _tiny_raw():
    raw = pt.raw_batch(2)
    raw["action"] = torch.cat([raw["action"], raw["action"]], dim=1)
    raw["action_is_pad"] = torch.cat([raw["action_is_pad"]] * 2, dim=1)
    return raw


def test_processor_matches_lerobot(oracle):
    raw = pt.raw_batch(3)
    ours = oracle["processor"](raw)
    theirs = oracle["pre"](dict(raw))
    assert torch.equal(ours["tokens"], theirs["observation.language.tokens"])
    assert torch.equal(ours["token_masks"], theirs["observation.language.attention_mask"])
    assert torch.equal(ours["actions"][..., : pt.ACTION_DIM], theirs["action"])
    images, masks = oracle["policy"]._preprocess_images(theirs)
    for i in range(len(pt.CAMERAS)):
        assert torch.equal(ours["images"][:, i], images[i])
        assert torch.equal(ours["image_masks"][:, i], masks[i])
    # postprocess = lerobot's unnormaliser
    chunk = torch.randn(3, 4, oracle["config"].max_action_dim)
    assert torch.allclose(oracle["processor"].postprocess(chunk), oracle["post"](chunk[..., : pt.ACTION_DIM]))


def test_loss_matches_lerobot(oracle):
    raw = pt.raw_batch(2)
    config = oracle["config"]
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(2, config.chunk_size, config.max_action_dim, generator=g)
    time = torch.tensor([0.3, 0.85])
    pt.fixed_draws(oracle["policy"], noise, time)
    with torch.no_grad():
        theirs, _ = oracle["policy"].forward(oracle["pre"](dict(raw)))
        ours, _ = oracle["loong"].loss(oracle["processor"](raw), noise=noise, time=time)
    assert pt.max_rel_err(ours, theirs) <= TOL, (ours.item(), theirs.item())


def test_loss_matches_lerobot_with_a_missing_camera(oracle):
    raw = pt.raw_batch(2)
    del raw[pt.CAMERAS[0]]  # lerobot appends a missing camera as a masked -1 image; Loong keeps its slot
    config = oracle["config"]
    noise = torch.randn(2, config.chunk_size, config.max_action_dim, generator=torch.Generator().manual_seed(3))
    time = torch.tensor([0.6, 0.4])
    pt.fixed_draws(oracle["policy"], noise, time)
    inputs = oracle["processor"](raw)
    assert inputs["image_masks"][:, 0].logical_not().all() and inputs["image_masks"][:, 1].all()
    with torch.no_grad():
        theirs, _ = oracle["policy"].forward(oracle["pre"](dict(raw)))
        ours, _ = oracle["loong"].loss(inputs, noise=noise, time=time)
    assert pt.max_rel_err(ours, theirs) <= TOL


def test_processor_save_load_round_trip(oracle, tmp_path):
    processor = oracle["processor"]
    processor.save(tmp_path)
    loaded = Pi05Processor.load(tmp_path, oracle["config"])
    raw = pt.raw_batch(2)
    a, b = processor(raw), loaded(raw)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    chunk = torch.randn(2, 4, oracle["config"].max_action_dim)
    assert torch.equal(processor.postprocess(chunk), loaded.postprocess(chunk))
    # one observation, channels-last uint8 as a gym env renders it
    obs = {pt.CAMERAS[0]: (raw[pt.CAMERAS[0]][0].permute(1, 2, 0) * 255).to(torch.uint8),
           pt.CAMERAS[1]: raw[pt.CAMERAS[1]][0], "observation.state": raw["observation.state"][0],
           "task": raw["task"][0]}
    one = processor(obs, train=False)
    assert one["images"].shape == (1, 2, 3, pt.IMAGE_SIZE, pt.IMAGE_SIZE)
    assert torch.equal(one["tokens"], a["tokens"][:1])
    with pytest.raises(LoongError, match="observation.state"):
        processor({"task": "x", pt.CAMERAS[0]: raw[pt.CAMERAS[0]]}, train=False)


def test_predict_action_chunk_matches_lerobot(oracle):
    raw = pt.raw_batch(2)
    config = oracle["config"]
    noise = torch.randn(2, config.chunk_size, config.max_action_dim, generator=torch.Generator().manual_seed(2))
    theirs = oracle["policy"].predict_action_chunk(oracle["pre"](dict(raw)), noise=noise.clone())
    ours = oracle["loong"].predict_action_chunk(oracle["processor"](raw, train=False), noise=noise)
    assert pt.max_rel_err(ours[..., : pt.ACTION_DIM], theirs) <= TOL
    # the cached prefix gives what the full joint forward gives at every Euler step
    inputs = oracle["processor"](raw, train=False)
    x = noise.clone()
    for step in range(config.num_inference_steps):
        t = torch.full((2,), 1.0 - step / config.num_inference_steps)
        with torch.no_grad():
            x = x - oracle["loong"].velocity(inputs, x, t) / config.num_inference_steps
    assert pt.max_rel_err(ours, x) <= TOL


def test_state_dict_round_trip_is_bit_exact(oracle):
    theirs = oracle["policy"].state_dict()
    config, ours = mapping.from_lerobot(oracle["lr_config"], theirs, vision_num_heads=2)
    _, back = mapping.to_lerobot(config, ours, oracle["processor"], check_vision=False)
    used = {k: v for k, v in theirs.items() if k not in mapping.UNUSED_KEYS}
    assert set(back) == set(theirs)
    for key, value in used.items():
        assert torch.equal(back[key], value), key
    assert torch.equal(back[mapping.PALIGEMMA_LM_HEAD], ours["embed_tokens.weight"])
    assert set(ours) == set(oracle["loong"].state_dict())


def test_to_lerobot_rejects_unpublished_sizes():
    tiny = POLICIES.get("pi05").presets["tiny"]
    with pytest.raises(LoongError, match="vocab_size"):
        mapping.to_lerobot(tiny, {})
    with pytest.raises(LoongError, match="SigLIP"):
        mapping.to_lerobot(tiny.replace(vocab_size=257152, num_heads=8), {})


def test_config_round_trips_through_json():
    import dataclasses
    import json

    for config in POLICIES.get("pi05").presets.values():
        assert Pi05Config(**json.loads(json.dumps(dataclasses.asdict(config)))) == config


def test_config_rejects_bad_values():
    with pytest.raises(LoongError, match="n_action_steps"):
        Pi05Config(chunk_size=4, n_action_steps=5)
    with pytest.raises(LoongError, match="patch_size"):
        Pi05Config(image_size=100)


@pytest.mark.gpu
def test_published_shape_trains_and_samples_in_bf16_on_gpu():
    """The published Pi0.5 on one GPU in bf16: two 224² cameras, a 200-token prompt; a finite loss with gradients
    everywhere trainable, and a finite action chunk from the cached-prefix sampler."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    config = POLICIES.get("pi05").presets["pi05"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        policy = Pi05Policy(config).to(torch.bfloat16)
    b, device = 2, torch.device("cuda")
    tokens = torch.randint(1, config.vocab_size, (b, config.tokenizer_max_length), device=device)
    token_masks = torch.ones(b, config.tokenizer_max_length, dtype=torch.bool, device=device)
    token_masks[1, 40:] = False
    inputs = {"images": torch.rand(b, 2, 3, 224, 224, device=device) * 2 - 1,
              "image_masks": torch.tensor([[True, True], [True, False]], device=device),
              "tokens": tokens, "token_masks": token_masks,
              "actions": torch.randn(b, config.chunk_size, config.max_action_dim, device=device),
              "action_mask": torch.ones(b, config.max_action_dim, dtype=torch.bool, device=device)}
    loss, _ = policy.loss(inputs)
    assert torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in policy.layers[0].expert.parameters())
    chunk = policy.predict_action_chunk(inputs)
    assert chunk.shape == (b, config.chunk_size, config.max_action_dim) and torch.isfinite(chunk).all()
