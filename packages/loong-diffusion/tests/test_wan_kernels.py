"""Wan's q/k RMSNorm and 3-D RoPE through loong-kernels (what the model takes where the accelerator reports Triton)
equal Loong's plain PyTorch: the fused interleaved-pair RoPE kernel run by Triton's interpreter on Wan's own
``[b, heads, tokens, head_dim]`` views and rotary tables, and a whole model built with the ``triton`` capability
(the kernels' dispatch, whose reference path runs on the CPU)."""

from __future__ import annotations

import pytest
import torch

from loong.diffusion.models.wan import WanTransformer
from loong.diffusion.models.wan.attention import split_heads
from loong.diffusion.models.wan.rope import grid_positions, rope_angles, rotate_qk


def test_the_fused_rope_kernel_rotates_as_wan_does(monkeypatch: pytest.MonkeyPatch, wan) -> None:  # noqa: ANN001
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    config = wan.tiny_config("t2v")
    cos, sin = rope_angles(grid_positions(3, 4, 5), config.rope_dims)
    g = torch.Generator().manual_seed(0)
    q, k = (split_heads(torch.randn(2, 60, config.dim, generator=g), config.num_heads) for _ in range(2))
    want = rotate_qk(q, k, cos, sin)
    got = rotate_qk(q, k, cos, sin, backend="triton")
    for a, b in zip(got, want, strict=True):
        assert wan.relative_error(a, b) <= 1e-6


def test_a_model_with_the_triton_capability_predicts_as_the_plain_one(wan) -> None:  # noqa: ANN001
    config = wan.tiny_config("t2v")
    torch.manual_seed(0)
    plain = WanTransformer(config).eval()
    wan.perturb(plain, seed=1)
    fused = WanTransformer(config, capabilities={"triton"}).eval()
    fused.load_state_dict(plain.state_dict())
    inputs = wan.wan_inputs(config)
    with torch.no_grad():
        want = plain(inputs["latents"], inputs["timestep"], inputs["text"])
        got = fused(inputs["latents"], inputs["timestep"], inputs["text"])
    assert wan.relative_error(got, want) <= 1e-6
