"""Loong's Wan transformer against diffusers' ``WanTransformer3DModel`` (0.42.x): the same random weights, copied
through the mapping, give the same prediction and the same parameter gradients (CPU, fp32).

Variants: Wan 2.1 T2V; Wan 2.1 I2V (36 input channels, CLIP image tokens through the added K/V projections);
first-last-frame I2V (the image embedder's position table over two images); Wan 2.2 TI2V (48 channels, a timestep
per token with the conditioning frame's tokens at 0). Errors are the largest absolute difference relative to the
largest absolute reference value, per tensor; measured 3e-7 to 6e-7 for the outputs and up to 5e-6 for the
gradients, the worst always a key bias (whose gradient is a sum of nearly cancelling terms: softmax ignores a shift
of every key, only the q/k norm makes it count).
"""

from __future__ import annotations

import pytest
import torch

from loong.diffusion.models.wan import to_diffusers

TOLERANCE = 1e-5
VARIANTS = ["t2v", "i2v", "flf2v", "ti2v"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_prediction_matches_diffusers(variant: str, wan_pair, wan) -> None:  # noqa: ANN001
    reference, ours, config = wan_pair(variant)
    inputs = wan.wan_inputs(config)
    with torch.no_grad():
        want = wan.run_diffusers(reference, inputs)
        got = ours(**inputs)
    assert got.shape == want.shape == (2, config.out_channels, 3, 8, 6)
    assert wan.relative_error(got, want) <= TOLERANCE


@pytest.mark.parametrize("variant", VARIANTS)
def test_gradients_match_diffusers(variant: str, wan_pair, wan) -> None:  # noqa: ANN001
    """The same loss (prediction · a fixed random tensor) gives every parameter the same gradient, compared under
    diffusers' names (the fused Loong gradients split by the mapping)."""
    reference, ours, config = wan_pair(variant)
    inputs = wan.wan_inputs(config, seed=3)
    direction = torch.randn(2, config.out_channels, 3, 8, 6, generator=torch.Generator().manual_seed(4))
    for model in (reference, ours):
        model.zero_grad(set_to_none=True)
    (wan.run_diffusers(reference, inputs) * direction).sum().backward()
    (ours(**inputs) * direction).sum().backward()
    want = {name: p.grad for name, p in reference.named_parameters()}
    got = to_diffusers({name: p.grad for name, p in ours.named_parameters()})
    assert set(got) == set(want)
    errors = {name: wan.relative_error(got[name], want[name]) for name in want}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, (worst, errors[worst])


def test_per_token_timesteps_are_per_token(wan_pair, wan) -> None:  # noqa: ANN001
    """TI2V: the conditioning frame's tokens at timestep 0 change the prediction there and elsewhere (through
    attention) — the per-token path is not the per-sample one — and diffusers agrees on both."""
    reference, ours, config = wan_pair("ti2v")
    inputs = wan.wan_inputs(config)
    uniform = dict(inputs, timestep=inputs["timestep"][:, -1])  # every token at the sample's t
    with torch.no_grad():
        per_token, per_sample = ours(**inputs), ours(**uniform)
        assert wan.relative_error(per_sample, wan.run_diffusers(reference, uniform)) <= TOLERANCE
    assert (per_token - per_sample).abs().amax() > 1e-2


def test_image_tokens_take_part(wan_pair, wan) -> None:  # noqa: ANN001
    """I2V: other image features give another prediction (the added K/V branch is live), as in diffusers."""
    reference, ours, config = wan_pair("i2v")
    inputs = wan.wan_inputs(config)
    other = dict(inputs, image=torch.randn_like(inputs["image"]))
    with torch.no_grad():
        changed = ours(**other)
        assert wan.relative_error(changed, wan.run_diffusers(reference, other)) <= TOLERANCE
        assert (changed - ours(**inputs)).abs().amax() > 1e-2
