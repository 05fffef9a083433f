"""A pack of clips equals the clips alone: ``WanTransformer.forward_packed`` over one sequence holding clips of
different grids, timesteps and text lengths gives each clip the prediction of its own ``forward``, and the packed
weighted loss (``packed_mse``) and every parameter gradient equal those of the clips' separate losses
``Σ_i w_i · MSE_i`` (CPU, fp32; T2V, TI2V with per-token timesteps and its conditioning frame masked out of the
loss, I2V and first-last-frame I2V with image tokens; with and without padding)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loong.core.errors import LoongError
from loong.diffusion.models.wan import PACK_INPUTS, WanTransformer, pack_clips, packed_mse, unpack_tokens

#: fp32, relative to each tensor's largest reference value (measured: predictions <= 4e-7, gradients <= 1e-6)
TOLERANCE = 1e-5
#: (latent frames, height, width, text tokens) of the clips: three grids (36, 8 and 12 tokens), three text lengths
CLIPS = [(3, 8, 6, 7), (2, 4, 4, 3), (1, 6, 8, 5)]
WEIGHTS = [0.5, 0.2, 0.3]
TIMESTEPS = [999.0, 250.5, 10.0]


def _clips(config, seed: int) -> list[dict]:  # noqa: ANN001
    g = torch.Generator().manual_seed(seed)
    pt, ph, pw = config.patch_size
    out = []
    for (frames, height, width, text_len), t in zip(CLIPS, TIMESTEPS, strict=True):
        tokens = (frames // pt) * (height // ph) * (width // pw)
        timestep = torch.tensor(t)
        mask = None
        if config.expand_timesteps:  # TI2V: 0 on the first latent frame's tokens, which leave the loss
            timestep = torch.full((tokens,), t)
            timestep[: tokens // (frames // pt)] = 0.0
            mask = (timestep > 0).float()
        clip = {"latents": torch.randn(config.in_channels, frames, height, width, generator=g),
                "timestep": timestep, "text": torch.randn(text_len, config.text_dim, generator=g),
                "target": torch.randn(config.out_channels, frames, height, width, generator=g)}
        if config.image_dim is not None:
            images = 2 if config.pos_embed_seq_len else 1
            clip["image"] = torch.randn(images, 5, config.image_dim, generator=g)
        if mask is not None and frames > 1:  # a one-frame clip has only its conditioning frame: no mask there
            clip["mask"] = mask
        out.append(clip)
    return out


def _clip_mse(model: WanTransformer, pred: torch.Tensor, clip: dict) -> torch.Tensor:
    """A clip's MSE, or with a token mask ``m`` (TI2V: 0 on the conditioning frame) ``Σ m·err / Σ m``."""
    if "mask" not in clip:
        return F.mse_loss(pred, clip["target"])
    err = (model.patchify(pred[None]) - model.patchify(clip["target"][None])).pow(2).mean(-1)[0]
    return (err * clip["mask"]).sum() / clip["mask"].sum()


def _separate(model: WanTransformer, clips: list[dict]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each clip's own prediction (batch of one) and ``Σ_i w_i · MSE_i``."""
    preds = []
    for clip in clips:
        timestep = clip["timestep"][None] if clip["timestep"].ndim else clip["timestep"].reshape(1)
        image = clip.get("image")
        preds.append(model(clip["latents"][None], timestep, clip["text"][None], image)[0])
    loss = sum(w * _clip_mse(model, p, c) for w, p, c in zip(WEIGHTS, preds, clips, strict=True))
    return preds, loss


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize(("variant", "multiple"), [("t2v", 1), ("t2v", 8), ("ti2v", 1), ("i2v", 3), ("flf2v", 1)])
def test_a_pack_equals_its_clips_alone(variant: str, multiple: int, wan) -> None:  # noqa: ANN001
    config = wan.tiny_config(variant)
    torch.manual_seed(0)
    model = WanTransformer(config)
    wan.perturb(model, seed=2)
    clips = _clips(config, seed=3)

    want_preds, want_loss = _separate(model, clips)
    want_loss.backward()
    want_grads = _grads(model)

    pack = pack_clips([c["latents"] for c in clips], [c["timestep"] for c in clips], [c["text"] for c in clips],
                      config.patch_size, images=[c["image"] for c in clips] if "image" in clips[0] else None,
                      targets=[c["target"] for c in clips], weights=WEIGHTS,
                      token_masks=[c.get("mask") for c in clips], multiple=multiple)
    length = sum(f * h * w for f, h, w in pack["grids"].tolist())
    assert length == 36 + 8 + 12 and pack["patches"].shape[1] == -(-length // multiple) * multiple
    assert pack["text_doc_ids"].tolist() == [[0] * 7 + [1] * 3 + [2] * 5]
    tokens = model.forward_packed(**{k: pack[k] for k in PACK_INPUTS if k in pack})
    got_preds = unpack_tokens(tokens, pack["grids"], config.patch_size)
    for got, want in zip(got_preds, want_preds, strict=True):
        assert got.shape == want.shape
        assert wan.relative_error(got, want) <= TOLERANCE
    got_loss = packed_mse(tokens, pack["target"], pack["token_weight"])
    assert abs(float(got_loss.detach()) - float(want_loss.detach())) <= TOLERANCE * float(want_loss.detach())
    got_loss.backward()
    got_grads = _grads(model)
    assert set(got_grads) == set(want_grads)
    errors = {n: wan.relative_error(got_grads[n], want_grads[n]) for n in want_grads}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, (worst, errors[worst])


def test_padding_tokens_reach_no_clip(wan) -> None:  # noqa: ANN001
    """A padded pack's padding tokens get no share of any clip: the real tokens' predictions equal the unpadded
    pack's, whatever the padding holds."""
    config = wan.tiny_config("t2v")
    torch.manual_seed(0)
    model = WanTransformer(config).eval()
    clips = _clips(config, seed=5)
    args = ([c["latents"] for c in clips], [c["timestep"] for c in clips], [c["text"] for c in clips],
            config.patch_size)
    plain, padded = pack_clips(*args), pack_clips(*args, multiple=16)
    padded["patches"][:, 56:] = 100.0  # what a padding token holds must not reach any clip
    with torch.no_grad():
        a = model.forward_packed(**{k: plain[k] for k in PACK_INPUTS if k in plain})
        b = model.forward_packed(**{k: padded[k] for k in PACK_INPUTS if k in padded})
    assert b.shape[1] == 64
    assert wan.relative_error(b[:, :56], a) <= TOLERANCE


def test_pack_inputs_are_checked(wan) -> None:  # noqa: ANN001
    config = wan.tiny_config("t2v")
    latents, text = torch.randn(16, 2, 4, 4), torch.randn(3, config.text_dim)
    with pytest.raises(LoongError, match=r"clip 0: a timestep must be one value or one per token \[8\]"):
        pack_clips([latents], [torch.zeros(5)], [text], config.patch_size)
    with pytest.raises(LoongError, match="clip 0: latents must be"):
        pack_clips([torch.randn(16, 2, 3, 4)], [torch.tensor(1.0)], [text], config.patch_size)
    pack = pack_clips([latents], [torch.tensor(1.0)], [text], config.patch_size, multiple=3)
    from loong.core.attention import CPGroups

    model = WanTransformer(config, CPGroups())
    with pytest.raises(LoongError, match="a pack's text must be"):
        model.forward_packed(**{**{k: pack[k] for k in PACK_INPUTS if k in pack}, "text": text})
