"""Loong's Wan transformer on its own: the token layout (patchify ⇄ unpatchify, the conv-free patch embedding),
the rotary tables against diffusers', input checks, and loong-kernels' fused RMSNorm (Triton's interpreter on CPU)
giving diffusers' prediction."""

from __future__ import annotations

import pytest
import torch

from loong.core.errors import LoongError
from loong.diffusion.models.wan import WanTransformer, wan_preset
from loong.diffusion.models.wan.norms import RMSNorm
from loong.diffusion.models.wan.rope import grid_positions, rope_angles


def test_patchify_is_the_inverse_of_unpatchify_and_the_embedding_is_the_conv() -> None:
    config = wan_preset("tiny").replace(patch_size=(2, 2, 3))
    model = WanTransformer(config)
    x = torch.randn(2, 16, 4, 6, 9)
    tokens = model.patchify(x)
    assert tokens.shape == (2, 2 * 3 * 3, 2 * 2 * 3 * 16)
    assert torch.equal(model.unpatchify(tokens, model.grid(x)), x)
    # the embedding as one matrix product over the patches is the Conv3d it stores, token for token
    conv = model.patch_embed(x).flatten(2).transpose(1, 2)
    from loong.diffusion.models.wan.model import to_patches

    patches = to_patches(x, config.patch_size, channels_last=False)
    linear = torch.nn.functional.linear(patches, model.patch_embed.weight.flatten(1), model.patch_embed.bias)
    assert torch.allclose(linear, conv, atol=1e-5, rtol=1e-5)


def test_rope_tables_are_diffusers_bit_for_bit() -> None:
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    reference = WanRotaryPosEmbed(attention_head_dim=128, patch_size=(1, 2, 2), max_seq_len=1024)
    want_cos, want_sin = reference(torch.zeros(1, 16, 5, 14, 18))  # a 5 x 7 x 9 grid
    cos, sin = rope_angles(grid_positions(5, 7, 9), wan_preset("wan2_1_t2v_14b").rope_dims)
    # diffusers repeats each pair's angle twice along the head; the even channels are the pairs
    assert torch.equal(cos, want_cos[0, :, 0, 0::2]) and torch.equal(sin, want_sin[0, :, 0, 1::2])


def test_bad_inputs_fail_clearly(wan_pair, wan) -> None:  # noqa: ANN001
    _, ours, config = wan_pair("t2v")
    inputs = wan.wan_inputs(config)
    with pytest.raises(LoongError, match="latents \\[batch, 16, frames, height, width\\]"):
        ours(**dict(inputs, latents=inputs["latents"][:, :4]))
    with pytest.raises(LoongError, match="must divide by the patch size"):
        ours(**dict(inputs, latents=inputs["latents"][..., :5]))
    with pytest.raises(LoongError, match="timestep must be \\[batch\\] or, per token, \\[batch, tokens\\] = \\[2, 36\\]"):
        ours(**dict(inputs, timestep=torch.zeros(2, 35)))
    with pytest.raises(LoongError, match="text must be \\[2, text_tokens, 32\\]"):
        ours(**dict(inputs, text=inputs["text"][..., :8]))
    with pytest.raises(LoongError, match="no image branch"):
        ours(**dict(inputs, image=torch.zeros(2, 5, 24)))
    _, i2v, i2v_config = wan_pair("i2v")
    with pytest.raises(LoongError, match="takes CLIP image features"):
        i2v(**dict(wan.wan_inputs(i2v_config), image=None))


def test_triton_capability_picks_the_fused_rmsnorm() -> None:
    norms = [m for m in WanTransformer(wan_preset("tiny"), capabilities={"triton"}).modules() if isinstance(m, RMSNorm)]
    assert norms and {m.backend for m in norms} == {"auto"}
    assert {m.backend for m in WanTransformer(wan_preset("tiny")).modules() if isinstance(m, RMSNorm)} == {None}


@pytest.mark.parametrize("variant", ["t2v", "i2v"])
def test_fused_rmsnorm_kernel_gives_diffusers_prediction(variant: str, wan_pair, wan, monkeypatch) -> None:  # noqa: ANN001
    """Every q/k RMSNorm through loong-kernels' Triton kernel (run by Triton's interpreter on CPU), forward and
    backward: the prediction and the norm weights' gradients are diffusers'."""
    from loong.kernels import triton_available

    if not triton_available():
        pytest.skip("Triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reference, ours, config = wan_pair(variant)
    fused = WanTransformer(config).eval()
    fused.load_state_dict(ours.state_dict())
    for module in fused.modules():
        if isinstance(module, RMSNorm):
            module.backend = "triton"  # the kernel or an error, never the reference
    inputs = wan.wan_inputs(config, seed=7)
    direction = torch.randn(2, config.out_channels, 3, 8, 6, generator=torch.Generator().manual_seed(8))
    reference.zero_grad(set_to_none=True)
    want = wan.run_diffusers(reference, inputs)
    (want * direction).sum().backward()
    got = fused(**inputs)
    (got * direction).sum().backward()
    assert wan.relative_error(got, want) <= 1e-5
    weight = fused.blocks[1].self_attn.k_norm.weight.grad
    assert wan.relative_error(weight, reference.blocks[1].attn1.norm_k.weight.grad) <= 1e-5
