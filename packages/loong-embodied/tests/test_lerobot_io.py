"""LeRobot policy folders: a Loong Pi0.5 exported by ``export_lerobot`` loads in lerobot 0.6.1 (``PI05Policy.
from_pretrained`` + ``make_pre_post_processors(pretrained_path=...)``, offline, seeded cache) with the same weights and
gives the same loss; ``import_lerobot`` of a folder lerobot's ``save_pretrained`` wrote gives back its weights and
statistics. The lerobot side is shrunk by the test-only patches of ``pi05_testing``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from loong.core.errors import LoongError
from loong.embodied.lerobot_io import export_lerobot, import_lerobot
from loong.embodied.policies.pi05 import Pi05Policy, Pi05Processor
from loong.embodied.policies.pi05 import lerobot as mapping

sys.path.insert(0, str(Path(__file__).parent))  # the shared fixtures module beside this file
import pi05_testing as pt  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    with pt.lerobot_patches(tmp_path_factory.mktemp("hub")):
        yield


def _loong_policy() -> tuple[Pi05Policy, Pi05Processor]:
    torch.manual_seed(3)
    config = pt.parity_config()
    policy = Pi05Policy(config).eval()
    with torch.no_grad():  # non-zero adaRMSNorm and norm weights, so every parameter matters
        for name, p in policy.named_parameters():
            if ".dense." in name or "norm" in name:
                p.normal_(0, 0.1)
    return policy, Pi05Processor(config, features=pt.features(), stats=pt.stats(), camera_keys=pt.CAMERAS)


def test_export_loads_in_lerobot_with_the_same_loss(patched, tmp_path):
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    policy, processor = _loong_policy()
    dst = export_lerobot("pi05", policy.config, policy.state_dict(), processor, tmp_path / "export",
                         check_vision=False)
    assert {p.name for p in dst.iterdir()} >= {"config.json", "model.safetensors", "policy_preprocessor.json",
                                               "policy_postprocessor.json"}
    theirs = PI05Policy.from_pretrained(str(dst)).eval()
    _, expected = mapping.to_lerobot(policy.config, policy.state_dict(), processor, check_vision=False)
    loaded = theirs.state_dict()
    assert set(loaded) == set(expected)
    for key, value in expected.items():  # from_pretrained only warns when weights do not load: check them all
        assert torch.equal(loaded[key], value), key
    # the pipelines are the ones lerobot's own Pi0.5 factory writes for these statistics
    from lerobot.policies.pi05.processor_pi05 import make_pi05_pre_post_processors
    from safetensors.torch import load_file

    own = tmp_path / "lerobot_own"
    for pipeline in make_pi05_pre_post_processors(theirs.config, dataset_stats=pt.stats()):
        pipeline.save_pretrained(own)
    for name in sorted(p.name for p in own.iterdir()):
        if name.endswith(".json"):
            assert json.loads((dst / name).read_text()) == json.loads((own / name).read_text()), name
        else:
            mine, lerobots = load_file(str(dst / name)), load_file(str(own / name))
            assert mine.keys() == lerobots.keys() and all(torch.equal(mine[k], lerobots[k]) for k in mine), name
    pre, post = make_pre_post_processors(theirs.config, pretrained_path=str(dst))
    raw = pt.raw_batch(2)
    noise = torch.randn(2, policy.config.chunk_size, policy.config.max_action_dim,
                        generator=torch.Generator().manual_seed(4))
    time = torch.tensor([0.2, 0.7])
    pt.fixed_draws(theirs, noise, time)
    with torch.no_grad():
        their_loss, _ = theirs.forward(pre(dict(raw)))
        our_loss, _ = policy.loss(processor(raw), noise=noise, time=time)
    assert pt.max_rel_err(our_loss, their_loss) <= TOL
    # and the robot actions: lerobot's chunk through its postprocessor = ours through Pi05Processor.postprocess
    their_actions = post(theirs.predict_action_chunk(pre(dict(raw)), noise=noise.clone()))
    our_actions = processor.postprocess(policy.predict_action_chunk(processor(raw, train=False), noise=noise))
    assert pt.max_rel_err(our_actions, their_actions) <= TOL


def test_import_of_a_lerobot_folder_gives_back_its_weights_and_stats(patched, tmp_path):
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy
    from lerobot.policies.pi05.processor_pi05 import make_pi05_pre_post_processors

    torch.manual_seed(5)
    lr_config = pt.lerobot_config()
    theirs = PI05Policy(lr_config)
    src = tmp_path / "lerobot_policy"
    theirs.save_pretrained(src)
    pre, post = make_pi05_pre_post_processors(lr_config, dataset_stats=pt.stats())
    pre.save_pretrained(src)
    post.save_pretrained(src)

    name, config, state_dict, stats = import_lerobot(src, vision_num_heads=pt.TINY_VISION["num_attention_heads"],
                                                     tokenizer="builtin:tiny")
    assert name == "pi05"
    assert config == pt.parity_config().replace(tokenizer="builtin:tiny")
    # what lerobot itself loads from the folder
    reloaded = PI05Policy.from_pretrained(str(src)).state_dict()
    assert set(state_dict) == set(Pi05Policy(config).state_dict())
    for key, value in state_dict.items():
        assert torch.equal(value, reloaded[mapping.to_lerobot_name(key)]), key
    for key in ("observation.state", "action"):
        for stat in ("q01", "q99"):
            assert torch.allclose(stats[key][stat].double(), torch.as_tensor(pt.stats()[key][stat]))
    Pi05Policy(config).load_state_dict(state_dict, strict=True)


def test_import_rejects_a_folder_that_is_not_a_policy(tmp_path):
    with pytest.raises(LoongError, match="config.json"):
        import_lerobot(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"type": "act"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(LoongError, match="'act'"):
        import_lerobot(tmp_path)


def test_fix_checkpoint_applies_lerobots_load_time_key_fixes():
    head, w, b = torch.randn(5, 2), torch.randn(2, 2), torch.randn(2)
    fixed = mapping.fix_checkpoint({mapping.PALIGEMMA_LM_HEAD: head, "action_time_mlp_in.weight": w,
                                    "model.action_time_mlp_out.bias": b, "state_proj.weight": w})
    embed = "model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
    assert torch.equal(fixed[embed], head)  # openpi's tied checkpoints carry the head only
    assert torch.equal(fixed["model.time_mlp_in.weight"], w) and torch.equal(fixed["model.time_mlp_out.bias"], b)
    assert not any("state_proj" in k for k in fixed)
    own = torch.randn(5, 2)
    assert torch.equal(mapping.fix_checkpoint({mapping.PALIGEMMA_LM_HEAD: head, embed: own})[embed], own)
