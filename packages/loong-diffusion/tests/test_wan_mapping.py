"""The diffusers mapping of Wan: state dicts both ways bit for bit, config fields, and folders —
Loong's writer gives what ``WanTransformer3DModel.from_pretrained`` loads (one file or shards), Loong's loader
reads what diffusers' ``save_pretrained`` writes; safetensors only."""

from __future__ import annotations

import json

import pytest
import torch

from loong.core.errors import LoongError
from loong.diffusion.models.wan import (
    WanTransformer,
    config_from_diffusers,
    config_to_diffusers,
    from_diffusers,
    load_diffusers,
    save_diffusers,
    to_diffusers,
)
from loong.diffusion.models.wan.mapping import RULES

VARIANTS = ["t2v", "i2v", "flf2v", "ti2v"]


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("variant", VARIANTS)
def test_state_dicts_round_trip_bit_exactly(variant: str, wan_pair) -> None:  # noqa: ANN001
    reference, ours, _ = wan_pair(variant)
    theirs = reference.state_dict()
    assert _equal(to_diffusers(from_diffusers(theirs)), theirs)
    assert _equal(from_diffusers(to_diffusers(ours.state_dict())), ours.state_dict())
    # every Loong parameter is named by the mapping and has the shape of what it holds
    mapped = from_diffusers(theirs)
    assert {k: v.shape for k, v in mapped.items()} == {k: v.shape for k, v in ours.state_dict().items()}


def test_fused_projections_stack_q_k_v_in_order(wan_pair) -> None:  # noqa: ANN001
    reference, ours, _ = wan_pair("i2v")
    attn1, attn2 = reference.blocks[1].attn1, reference.blocks[1].attn2
    block = ours.blocks[1]
    assert torch.equal(block.self_attn.qkv.weight, torch.cat([attn1.to_q.weight, attn1.to_k.weight,
                                                              attn1.to_v.weight]))
    assert torch.equal(block.cross_attn.kv.bias, torch.cat([attn2.to_k.bias, attn2.to_v.bias]))
    assert torch.equal(block.cross_attn.image_kv.weight, torch.cat([attn2.add_k_proj.weight,
                                                                    attn2.add_v_proj.weight]))


def test_every_rule_is_used_by_some_variant(wan_pair) -> None:  # noqa: ANN001
    """No declared rule is dead: the variants together hold a parameter of each."""
    names = set()
    for variant in VARIANTS:
        names |= set(wan_pair(variant)[1].state_dict())
    stems = {rule.loong.replace("{n}", "1") for rule in RULES}
    assert all(any(name.startswith(stem + ".") or name == stem for name in names) for stem in stems)


@pytest.mark.parametrize("variant", ["t2v", "ti2v"])
def test_config_fields_match_diffusers(variant: str, wan_pair) -> None:  # noqa: ANN001
    reference, _, config = wan_pair(variant)
    ours = config_to_diffusers(config)
    assert {k: v for k, v in ours.items() if not k.startswith("_")} == {
        k: list(v) if isinstance(v, tuple) else v for k, v in reference.config.items() if not k.startswith("_")}
    assert config_from_diffusers(dict(reference.config), expand_timesteps=config.expand_timesteps) == config


@pytest.mark.parametrize(("variant", "shard_bytes"), [("i2v", None), ("ti2v", 40_000)], ids=["one_file", "sharded"])
def test_written_folder_loads_in_diffusers(variant: str, shard_bytes: int | None, wan_pair, wan,  # noqa: ANN001
                                           tmp_path) -> None:
    from diffusers import WanTransformer3DModel

    reference, ours, config = wan_pair(variant)
    kwargs = {} if shard_bytes is None else {"max_shard_bytes": shard_bytes}
    folder = save_diffusers(ours.state_dict(), config, tmp_path / "transformer", **kwargs)
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) == 1 if shard_bytes is None else len(shards) > 2
    loaded = WanTransformer3DModel.from_pretrained(folder).eval()
    assert _equal(loaded.state_dict(), reference.state_dict())
    inputs = wan.wan_inputs(config, seed=5)
    with torch.no_grad():
        assert torch.equal(wan.run_diffusers(loaded, inputs), wan.run_diffusers(reference, inputs))
        assert wan.relative_error(ours(**inputs), wan.run_diffusers(loaded, inputs)) <= 1e-5
    # and back: Loong's loader reads its own (sharded) export into an equal model
    again = load_diffusers(folder, expand_timesteps=config.expand_timesteps)
    assert again.config == config and _equal(again.state_dict(), ours.state_dict())


def test_loader_reads_a_diffusers_save_pretrained_folder(wan_pair, wan, tmp_path) -> None:  # noqa: ANN001
    reference, ours, config = wan_pair("t2v")
    reference.save_pretrained(tmp_path / "transformer")
    model = load_diffusers(tmp_path / "transformer", dtype=torch.float32)
    assert isinstance(model, WanTransformer) and model.config == config
    assert all(p.device.type == "cpu" and p.requires_grad for p in model.parameters())
    inputs = wan.wan_inputs(config, seed=6)
    with torch.no_grad():
        assert torch.equal(model(**inputs), ours(**inputs))



def test_a_bf16_load_keeps_diffusers_fp32_parameters_and_its_prediction(wan_pair, wan, tmp_path) -> None:  # noqa: ANN001
    """In bf16, diffusers keeps the modulation tables, the timestep MLP and the cross-attention norms in fp32; Loong's
    loader keeps the same tensors, and the bf16 predictions agree (measured: equal; a model cast wholly to bf16 is
    7e-3 off)."""
    from diffusers import WanTransformer3DModel

    reference, _, config = wan_pair("t2v")
    reference.save_pretrained(tmp_path / "transformer")
    theirs = WanTransformer3DModel.from_pretrained(tmp_path / "transformer", torch_dtype=torch.bfloat16).eval()
    ours = load_diffusers(tmp_path / "transformer", dtype=torch.bfloat16).eval()
    fp32 = {k for k, v in to_diffusers(ours.state_dict()).items() if v.dtype == torch.float32}
    assert fp32 == {k for k, v in theirs.state_dict().items() if v.dtype == torch.float32} and fp32
    inputs = wan.wan_inputs(config, seed=6)
    inputs = dict(inputs, latents=inputs["latents"].bfloat16(), text=inputs["text"].bfloat16())
    with torch.no_grad():
        got, want = ours(**inputs), wan.run_diffusers(theirs, inputs)
    assert got.dtype == want.dtype == torch.bfloat16
    assert wan.relative_error(got, want) <= 2e-3


def test_folders_without_safetensors_or_config_are_refused(wan_pair, tmp_path) -> None:  # noqa: ANN001
    reference, _, _ = wan_pair("t2v")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(dict(reference.config)))
    torch.save(reference.state_dict(), pickled / "diffusion_pytorch_model.bin")
    with pytest.raises(LoongError, match="does not unpickle diffusion_pytorch_model.bin"):
        load_diffusers(pickled)
    (tmp_path / "pipeline" / "transformer").mkdir(parents=True)
    (tmp_path / "pipeline" / "transformer" / "config.json").write_text("{}")
    with pytest.raises(LoongError, match="pipeline folder, pass .*transformer"):
        load_diffusers(tmp_path / "pipeline")


def test_unknown_and_incomplete_weights_fail_by_name(wan_pair) -> None:  # noqa: ANN001
    reference, ours, config = wan_pair("t2v")
    theirs = dict(reference.state_dict())
    with pytest.raises(LoongError, match="'blocks.0.attn1.to_q.weight' is fused with 'blocks.0.attn1.to_v.weight'"):
        from_diffusers({k: v for k, v in theirs.items() if k != "blocks.0.attn1.to_v.weight"})
    with pytest.raises(LoongError, match="'blocks.0.extra.weight' is not a Wan transformer weight"):
        from_diffusers({**theirs, "blocks.0.extra.weight": torch.zeros(1)})
    with pytest.raises(LoongError, match="fused part without its first part"):
        from_diffusers({k: v for k, v in theirs.items() if k != "blocks.0.attn1.to_q.weight"})
    # diffusers' own ignore list (norm_added_q, in some converted checkpoints) is skipped, as diffusers skips it
    assert _equal(from_diffusers({**theirs, "blocks.0.attn2.norm_added_q.weight": torch.ones(64)}),
                  from_diffusers(theirs))
    with pytest.raises(LoongError, match="is not a Wan parameter"):
        to_diffusers({**ours.state_dict(), "blocks.0.lora.weight": torch.zeros(1)})
    with pytest.raises(LoongError, match="unknown WanTransformer3DModel config field"):
        config_from_diffusers({**config_to_diffusers(config), "num_frames": 3})
