"""Flow matching's formulas (:mod:`loong.diffusion.flow`) against values worked out by hand."""

from __future__ import annotations

import torch

from loong.diffusion.flow import flow_sample, noisy_sample, sample_sigma, shift_sigma


def test_shift_is_wans_formula() -> None:
    sigma = torch.tensor([0.0, 0.25, 0.5, 1.0])
    assert torch.equal(shift_sigma(sigma, 1.0), sigma)
    # shift 3 at σ = 0.5: 1.5 / (1 + 2·0.5) = 0.75; at 0.25: 0.75 / 1.5 = 0.5; the ends stay put
    torch.testing.assert_close(shift_sigma(sigma, 3.0), torch.tensor([0.0, 0.5, 0.75, 1.0]))
    assert (shift_sigma(sigma[1:3], 5.0) > sigma[1:3]).all()  # a shift above 1 makes timesteps noisier


def test_noisy_sample_and_target() -> None:
    x0, noise = torch.full((2, 3), 2.0), torch.full((2, 3), -1.0)
    noisy, target = noisy_sample(x0, noise, torch.tensor(0.25))
    torch.testing.assert_close(noisy, torch.full((2, 3), 0.75 * 2.0 + 0.25 * -1.0))
    torch.testing.assert_close(target, torch.full((2, 3), -3.0))


def test_sigma_distributions() -> None:
    g = torch.Generator().manual_seed(0)
    uniform = torch.stack([sample_sigma(g, "uniform") for _ in range(4000)])
    assert 0.0 <= uniform.min() and uniform.max() <= 1.0
    assert abs(uniform.mean() - 0.5) < 0.02 and abs(uniform.var() - 1 / 12) < 0.01
    logit = torch.stack([sample_sigma(g, "logit_normal", logit_mean=1.0, logit_std=0.5) for _ in range(4000)])
    torch.testing.assert_close(torch.logit(logit).mean(), torch.tensor(1.0), atol=0.03, rtol=0)
    torch.testing.assert_close(torch.logit(logit).std(), torch.tensor(0.5), atol=0.03, rtol=0)
    shifted = torch.stack([sample_sigma(g, "uniform", shift=3.0) for _ in range(4000)])
    assert shifted.mean() > 0.6  # E[3u / (1 + 2u)] = 1.5 - 0.75 ln 3 / ... ≈ 0.676


def test_flow_sample_is_a_function_of_seed_and_index() -> None:
    x0, text = torch.randn(4, 2, 4, 4), torch.randn(5, 8)
    a, b = flow_sample(x0, text, 7, 3), flow_sample(x0, text, 7, 3)
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = flow_sample(x0, text, 7, 4)
    assert not torch.equal(a["noisy"], c["noisy"])
    torch.testing.assert_close(a["timestep"], 1000 * a["sigma"])
    # x_t = x0 + σ·(ε − x0): the sample's own σ and target give its clean latents back
    torch.testing.assert_close(a["noisy"] - a["sigma"] * a["target"], x0)


def test_text_dropout() -> None:
    x0, text = torch.randn(1, 1, 2, 2), torch.randn(3, 4)
    assert all(torch.equal(flow_sample(x0, text, 0, i, text_drop_prob=0.0)["text"], text) for i in range(20))
    assert all(not flow_sample(x0, text, 0, i, text_drop_prob=1.0)["text"].any() for i in range(20))
    dropped = sum(not flow_sample(x0, text, 0, i, text_drop_prob=0.3)["text"].any() for i in range(1000))
    assert 240 < dropped < 360
    # dropout does not change the noise or σ a sample draws
    assert torch.equal(flow_sample(x0, text, 0, 5, text_drop_prob=1.0)["noisy"], flow_sample(x0, text, 0, 5)["noisy"])
