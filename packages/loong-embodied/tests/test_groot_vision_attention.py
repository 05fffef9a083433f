"""GR00T N1.7's vision tower attends over all the images of a batch in one call per layer
(``groot_n1_7/vision_attention.py``); the oracle is transformers' own Qwen3-VL vision tower with SDPA, which runs
attention image by image."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AttentionInterface

from loong.embodied.policies.groot_n1_7 import vision_attention
from loong.embodied.policies.groot_n1_7.config import tiny
from loong.embodied.policies.groot_n1_7.model import build_backbone


@pytest.fixture(scope="module")
def towers():
    torch.manual_seed(0)
    ours = build_backbone(tiny()).visual.eval()
    theirs = copy.deepcopy(ours)
    theirs.config._attn_implementation = "sdpa"  # transformers' per-image path
    return ours, theirs


def _pixels(grid: torch.Tensor, config) -> torch.Tensor:
    width = config.in_channels * config.temporal_patch_size * config.patch_size**2
    return torch.randn(int(grid.prod(-1).sum()), width)


@pytest.mark.parametrize("grid", [[[1, 4, 6]] * 5, [[1, 4, 6], [1, 2, 4], [1, 4, 4]]], ids=["same-size", "mixed"])
def test_equals_transformers_per_image_attention(towers, grid) -> None:
    ours, theirs = towers
    assert ours.config._attn_implementation == vision_attention.IMPLEMENTATION
    grid_t = torch.tensor(grid)
    pixels = _pixels(grid_t, ours.config)
    a, b = ours(pixels, grid_thw=grid_t, return_dict=True), theirs(pixels, grid_thw=grid_t, return_dict=True)
    torch.testing.assert_close(a.pooler_output, b.pooler_output, rtol=1e-5, atol=1e-6)
    for x, y in zip(a.deepstack_features, b.deepstack_features, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    grad_a, grad_b = (_gradients(tower, pixels, grid_t) for tower in (ours, theirs))
    assert any(g is not None for g in grad_a)
    for x, y in zip(grad_a, grad_b, strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


def _gradients(tower, pixels: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    out = tower(pixels, grid_thw=grid, return_dict=True)
    loss = out.pooler_output.square().sum() + sum(d.square().sum() for d in out.deepstack_features)
    return torch.autograd.grad(loss, list(tower.parameters()), allow_unused=True)


def test_one_call_per_layer_with_the_image_boundaries(towers) -> None:
    ours, _ = towers
    seen: list[bool] = []

    def counted(*args, **kwargs):
        seen.append(kwargs.get("cu_seq_lens_q") is not None)
        return vision_attention.image_batched_attention(*args, **kwargs)

    AttentionInterface.register(vision_attention.IMPLEMENTATION, counted)
    try:
        grid = torch.tensor([[1, 4, 6]] * 7)
        ours(_pixels(grid, ours.config), grid_thw=grid, return_dict=True)
    finally:
        AttentionInterface.register(vision_attention.IMPLEMENTATION, vision_attention.image_batched_attention)
    assert seen == [True] * ours.config.depth, seen
