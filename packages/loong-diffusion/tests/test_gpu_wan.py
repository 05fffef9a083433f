"""Wan on a GPU (``pytest -m gpu``; CI deselects these, and without CUDA they skip).

- Parity in bf16 at the Wan2.1-T2V-1.3B widths (two layers): Loong's model (with loong-kernels' fused q/k RMSNorm
  where Triton is there) and diffusers' ``WanTransformer3DModel`` with the same weights, each in bf16, are compared
  with diffusers in fp32; Loong's bf16 error may not exceed diffusers' own bf16 error by more than half again.
- Packed clips on the GPU's varlen attention (FlexAttention block masks) equal the clips run one by one.
- ``loong-diffusion train`` on the GPU (bf16, eager and compiled, selective recompute): finite, falling losses.
- A compiled Wan block at the 1.3B shape, one clip of 32,760 tokens, with the task's inductor options: its
  modulation gradients are as close to fp32 eager as eager bf16's (inductor's mix-order reductions gave 10%).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from wan_testing import perturb, train_losses

from loong.core.accelerators import select_accelerator
from loong.diffusion.cli import main
from loong.diffusion.models.wan import (
    PACK_INPUTS,
    WanTransformer,
    config_to_diffusers,
    from_diffusers,
    pack_clips,
    unpack_tokens,
)
from loong.diffusion.models.wan.config import wan_preset

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("preset", ["wan2_1_t2v_1_3b", "wan2_2_ti2v_5b"])
def test_bf16_prediction_is_as_close_to_fp32_diffusers_as_diffusers_bf16(preset: str) -> None:
    from diffusers import WanTransformer3DModel

    config = wan_preset(preset).replace(num_layers=2)
    fields = {k: v for k, v in config_to_diffusers(config).items() if not k.startswith("_")}
    torch.manual_seed(0)
    reference = WanTransformer3DModel(**fields).eval()
    perturb(reference, seed=2)  # no norm weight 1, no bias 0
    reference.cuda()
    capabilities = select_accelerator().capabilities()
    ours = WanTransformer(config, capabilities=capabilities).cuda().eval()
    ours.load_state_dict(from_diffusers(reference.state_dict()), strict=True)

    g = torch.Generator(device="cuda").manual_seed(1)
    latents = torch.randn(1, config.in_channels, 3, 30, 52, generator=g, device="cuda")
    tokens = 3 * 15 * 26
    timestep = torch.full((1, tokens) if config.expand_timesteps else (1,), 600.0, device="cuda")
    text = torch.randn(1, 64, config.text_dim, generator=g, device="cuda")
    with torch.no_grad():
        want = reference(latents, timestep, text, return_dict=False)[0]
        reference.to(torch.bfloat16)
        theirs = reference(latents.bfloat16(), timestep, text.bfloat16(), return_dict=False)[0]
        ours.to(torch.bfloat16)
        got = ours(latents.bfloat16(), timestep, text.bfloat16())
    assert got.shape == want.shape
    ours_err, theirs_err = _rel(got, want), _rel(theirs, want)
    assert ours_err <= 1.5 * theirs_err + 1e-3, (ours_err, theirs_err)


def test_a_pack_on_the_gpus_varlen_attention_equals_its_clips_alone() -> None:
    """FlexAttention's block masks (self-attention within a clip, cross-attention to its own text) in fp32 on CUDA:
    the pack's predictions equal each clip's own forward."""
    config = wan_preset("tiny").replace(num_heads=2, head_dim=64)  # FlexAttention on CUDA wants head_dim >= 16
    torch.manual_seed(0)
    model = WanTransformer(config, capabilities=select_accelerator().capabilities()).cuda()
    g = torch.Generator().manual_seed(3)
    shapes = [(3, 16, 12, 7), (2, 8, 8, 3), (1, 12, 16, 5)]  # 144, 32 and 48 tokens; three text lengths
    clips = [(torch.randn(16, f, h, w, generator=g), torch.tensor(t), torch.randn(s, config.text_dim, generator=g))
             for (f, h, w, s), t in zip(shapes, (999.0, 250.5, 10.0), strict=True)]
    pack = pack_clips(*zip(*clips, strict=True), config.patch_size, multiple=128)
    pack = {k: v.cuda() for k, v in pack.items()}
    with torch.no_grad():
        tokens = model.forward_packed(**{k: pack[k] for k in PACK_INPUTS if k in pack})
        got = unpack_tokens(tokens, pack["grids"].cpu(), config.patch_size)
        for (latents, t, text), pred in zip(clips, got, strict=True):
            want = model(latents[None].cuda(), t.reshape(1).cuda(), text[None].cuda())[0]
            assert _rel(pred, want) <= 1e-4, _rel(pred, want)


def test_a_compiled_block_at_one_clip_gets_the_modulation_gradient_right() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    from wan_compile_check import (
        run_case,  # the benchmark's block, inputs and error measure, with the task's options
    )

    row = run_case("wan2_1_t2v_1_3b", 1, "none", (21, 30, 52), 512)
    errors = row["vs_fp32_eager"]
    for which in ("modulation", "modulation_input"):
        assert errors[f"compiled_{which}"] <= 2 * errors[f"eager_{which}"] + 1e-3, errors
    assert row["grad_x"] <= 2e-2 and row["out"] <= 2e-2, row


@pytest.mark.parametrize("extra", [(), ("train.compile=true", "model.recompute=selective")], ids=["eager", "compile"])
def test_the_default_run_trains_on_the_gpu(tmp_path: Path, extra: tuple[str, ...]) -> None:
    args = ["train", "train.steps=30", "train.progress=false", "train.eval_interval=0", "train.save_final=false",
            "train.precision=bf16", f"output_dir={tmp_path}", "run_name=gpu", *extra]
    assert main(args) == 0
    losses = train_losses(tmp_path / "gpu")
    assert len(losses) == 30 and all(map(lambda x: x == x and abs(x) < 1e3, losses))
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
