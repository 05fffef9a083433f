"""Image-to-video conditioning of a training sample, built as Wan's diffusers pipelines condition inference.

Three kinds of Wan model take a first frame (:func:`image_kind`):

- ``channels`` (Wan 2.1 I2V-14B and FLF2V-14B, Wan 2.2 I2V-A14B; ``in_channels = 2·out_channels + 4``): the model
  input is the noisy latent, a 4-channel frame mask and the condition latent, concatenated on channels in that order
  (``WanImageToVideoPipeline``: ``cat([latents, mask, condition])``). The mask is built at pixel-frame resolution and
  folded by the VAE's temporal factor 4, so the first latent frame's four mask channels are 1 (and, first-last-frame,
  only the fourth channel of the last latent frame). The whole clip is noised and every token is in the loss.
- Wan 2.1 I2V also takes CLIP image features of the frame (of both frames, joined, for FLF2V) through its image
  embedder and added K/V projections.
- ``latent`` (Wan 2.2 TI2V-5B, ``expand_timesteps``): with probability ``data.image_cond_prob`` the first latent
  frame of the noisy input is replaced by the clean latent and its tokens take timestep 0 (the pipeline's
  ``first_frame_mask``); those tokens leave the loss, since their input already is the answer. Otherwise the sample
  trains text-to-video.

The condition latent a pipeline feeds is the VAE latent of the frame followed by empty frames. The Wan VAE is causal
in time, so its first latent frame is the latent of the first pixel frame alone: the clip's own first latent frame.
The later frames need the VAE: ``loong-diffusion preprocess --condition first|first_last`` stores the condition
latent per clip (and ``--image-encoder`` the CLIP features), and :func:`condition_latent` takes it from there; the
synthetic set has none and stands in zeros (and, first-last-frame, the clip's own last latent frame).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from loong.core.attention import CPGroups, shard_sequence
from loong.core.errors import LoongError
from loong.diffusion.data.shards import read_index
from loong.diffusion.models.wan.config import WanConfig

#: channels of the I2V frame mask: the Wan VAE's temporal compression (pixel frames per latent frame)
MASK_CHANNELS = 4


def image_kind(wan: WanConfig) -> Literal["none", "channels", "latent"]:
    """How ``wan`` takes a conditioning frame: not at all (T2V), concatenated on channels, or in the latent (TI2V)."""
    if wan.expand_timesteps:
        return "latent"
    if wan.in_channels == 2 * wan.out_channels + MASK_CHANNELS:
        return "channels"
    if wan.in_channels != wan.out_channels:
        raise LoongError(f"model.in_channels={wan.in_channels}: Wan takes out_channels ({wan.out_channels}) for "
                         f"text-to-video or 2·out_channels + {MASK_CHANNELS} = {2 * wan.out_channels + MASK_CHANNELS} "
                         "for image-to-video (noise, frame mask, condition latent)")
    return "none"


def last_frame_too(wan: WanConfig) -> bool:
    """Whether ``wan`` is conditioned on the first and the last frame (Wan 2.1 FLF2V: two images' CLIP tokens)."""
    return wan.pos_embed_seq_len is not None


def frame_mask(latent_frames: int, height: int, width: int, last: bool = False) -> torch.Tensor:
    """The ``[4, latent_frames, height, width]`` mask of the given frames, as ``WanImageToVideoPipeline`` builds it:
    1 on the first pixel frame (``last``: and on the last), repeated ×4 for the first latent frame, then every four
    pixel frames folded into one latent frame's four channels."""
    pixel = torch.zeros(MASK_CHANNELS * (latent_frames - 1) + 1, height, width)
    pixel[0] = 1
    if last:
        pixel[-1] = 1
    folded = torch.cat([pixel[:1].expand(MASK_CHANNELS, -1, -1), pixel[1:]])  # [4 · latent_frames, h, w]
    return folded.reshape(latent_frames, MASK_CHANNELS, height, width).transpose(0, 1)


def condition_latent(latents: torch.Tensor, padded: torch.Tensor | None = None, last: bool = False) -> torch.Tensor:
    """The condition latent of a clip ``latents [c, F, H, W]``: ``padded`` where the data has it (the VAE latent of
    the clip's first frame, and for ``last`` its last, with empty frames between: exactly what the pipeline feeds),
    else a stand-in for data without a VAE: the clip's first latent frame (which a causal VAE gives alike), its last
    for ``last``, zeros between."""
    if padded is not None:
        return padded
    cond = torch.zeros_like(latents)
    cond[:, 0] = latents[:, 0]
    if last:
        cond[:, -1] = latents[:, -1]
    return cond


def channel_input(noisy: torch.Tensor, condition: torch.Tensor, last: bool = False) -> torch.Tensor:
    """The ``[2c + 4, F, H, W]`` input of a channel-conditioned model: noisy latent, frame mask, condition latent."""
    mask = frame_mask(*noisy.shape[1:], last=last).to(noisy.dtype)
    return torch.cat([noisy, mask, condition])


def first_frame_tokens(wan: WanConfig, latent_shape: tuple[int, int, int]) -> int:
    """Tokens of the first latent frame of a clip ``(F, H, W)`` (its first ``patch_t`` frames: one patch row)."""
    _, h, w = latent_shape
    pt, ph, pw = wan.patch_size
    if pt != 1:
        raise LoongError(f"first-frame conditioning needs model.patch_size[0] = 1 (a token per latent frame), "
                         f"got {pt}")
    return (h // ph) * (w // pw)


def latent_input(noisy: torch.Tensor, latents: torch.Tensor, timestep: torch.Tensor, wan: WanConfig
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TI2V: ``(input, per-token timestep, per-token loss weight)`` of a clip whose first frame conditions it; the
    first latent frame is the clean latent, its tokens take timestep 0 and weight 0."""
    first = first_frame_tokens(wan, tuple(latents.shape[1:]))
    tokens = first * latents.shape[1]
    x = noisy.clone()
    x[:, 0] = latents[:, 0]
    per_token = timestep.expand(tokens).clone()
    per_token[:first] = 0
    weight = torch.ones(tokens)
    weight[:first] = 0
    return x, per_token, weight




def synthetic_image_features(seed: int, label: int, tokens: int, dim: int) -> torch.Tensor:
    """CLIP-like image features ``[tokens, dim]`` of synthetic class ``label`` (fixed per class and seed, unit
    variance): the synthetic set has no pixels to encode, so its image condition, like its text, names the class."""
    g = torch.Generator().manual_seed((seed * 1_000_000_007 + 104_729 * (label + 1)) % (2**63 - 1))
    return torch.randn(tokens, dim, generator=g)


#: the stream offset of a TI2V sample's draw of whether its first frame conditions it
_IMAGE_COND_STREAM = 7_368_787


def check_conditioning(cfg: Any, wan: WanConfig) -> None:
    """Refuse, before anything starts, a run whose data cannot condition ``wan`` the way it needs."""
    kind = image_kind(wan)
    d = cfg.data
    if cfg.model.expert == "both" and wan.experts == 2 and cfg.parallel.fsdp == "none":
        raise LoongError("model.expert=both trains one A14B expert a step, leaving the other's parameters unused, "
                         "which DDP (parallel.fsdp=none) refuses; use parallel.fsdp=full|hybrid or train one expert "
                         "(model.expert=high_noise|low_noise)")
    if d.pack_tokens and wan.experts == 2 and cfg.model.expert == "both":
        raise LoongError("data.pack_tokens packs clips for one transformer; with model.expert=both (two A14B "
                         "experts) set data.pack_tokens=0 or train one expert (model.expert=high_noise|low_noise)")
    if kind == "none":
        return
    if d.source == "shards" and kind == "channels":  # TI2V needs only the clip's own first latent frame
        check_shard_conditioning(cfg, wan, read_index(d.path))
    if kind == "latent":
        first_frame_tokens(wan, (1, 1, 1))  # patch_size[0] must be 1
    if wan.pos_embed_seq_len is not None and 2 * d.image_len != wan.pos_embed_seq_len:
        raise LoongError(f"data.image_len={d.image_len}: the first-last-frame model's image position table holds "
                         f"model.pos_embed_seq_len={wan.pos_embed_seq_len} tokens, two images of "
                         f"{wan.pos_embed_seq_len // 2}; set data.image_len={wan.pos_embed_seq_len // 2}")


def check_shard_conditioning(cfg: Any, wan: WanConfig, index: dict[str, Any]) -> None:
    """Refuse a channel-conditioned model on shards (``index``: their ``index.json``) that do not hold its
    condition: the condition latent of its frames (``first``, FLF2V ``first_last``) and, for a model with
    ``image_dim`` (Wan 2.1), CLIP features of that width and ``data.image_len`` tokens per image."""
    where, preset = f"data.path={cfg.data.path}", f"model.preset={cfg.model.preset}"
    want = "first_last" if last_frame_too(wan) else "first"
    held = index.get("condition", "none")
    if held == "none":
        raise LoongError(f"{where} holds no condition latents, which {preset} (image-to-video by channels) takes "
                         f"as input: preprocess the clips with --condition {want}"
                         + (" --image-encoder PIPELINE" if wan.image_dim is not None else "")
                         + " into a new folder (or train it on data.source=synthetic)")
    if held != want:
        raise LoongError(f"{where} was preprocessed with --condition {held}, but {preset} is conditioned on "
                         f"{'the first and last frame' if want == 'first_last' else 'the first frame'}: preprocess "
                         f"with --condition {want} into a new folder")
    if wan.image_dim is None:
        return
    image = index.get("image")
    if image is None:
        raise LoongError(f"{where} holds no CLIP image features, which {preset} (model.image_dim={wan.image_dim}) "
                         f"takes: preprocess with --condition {want} --image-encoder PIPELINE (the model's "
                         "diffusers pipeline folder, with image_encoder/ and image_processor/) into a new folder")
    if image["dim"] != wan.image_dim:
        raise LoongError(f"{where} holds CLIP features of width {image['dim']}, but {preset} takes "
                         f"model.image_dim={wan.image_dim}: preprocess with the model's image encoder (Wan 2.1: "
                         "CLIP ViT-H/14, 1280), or set model.image_dim")
    if image["tokens"] != cfg.data.image_len:
        raise LoongError(f"data.image_len={cfg.data.image_len}, but {where} holds {image['tokens']} CLIP tokens per "
                         f"image; set data.image_len={image['tokens']}")


def condition_sample(wan: WanConfig, cfg: Any, clip: dict[str, torch.Tensor], flow: dict[str, torch.Tensor],
                     index: int, label: int | None) -> dict[str, torch.Tensor]:
    """The entries of training sample ``index`` that image conditioning replaces or adds: ``noisy`` (the model's
    input), and ``image`` (Wan 2.1 I2V) or ``timestep`` and ``weight`` (TI2V). ``clip``: its ``latents`` (and, where
    the data has them, ``condition`` / ``image``); ``flow``: :func:`~loong.diffusion.flow.flow_sample`'s draw;
    ``label``: the synthetic class that seeds synthetic image features."""
    kind = image_kind(wan)
    if kind == "channels":
        last = last_frame_too(wan)
        cond = condition_latent(clip["latents"], clip.get("condition"), last=last)
        out = {"noisy": channel_input(flow["noisy"], cond, last=last)}
        if wan.image_dim is not None:
            image = clip.get("image")
            if image is None:
                images = 2 if last else 1
                image = synthetic_image_features(cfg.data.seed, int(label or 0), images * cfg.data.image_len,
                                                 wan.image_dim)
            out["image"] = image
        return out
    g = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + _IMAGE_COND_STREAM + index)
    tokens = first_frame_tokens(wan, tuple(clip["latents"].shape[1:])) * clip["latents"].shape[1]
    if float(torch.rand((), generator=g)) < cfg.data.image_cond_prob:
        noisy, timestep, weight = latent_input(flow["noisy"], clip["latents"], flow["timestep"], wan)
        return {"noisy": noisy, "timestep": timestep, "weight": weight}
    return {"timestep": flow["timestep"].expand(tokens), "weight": torch.ones(tokens)}


def weighted_mse(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, groups: CPGroups) -> torch.Tensor:
    """This CP rank's share of the micro-batch's token-weighted MSE: Σ w·err over its shard of the tokens, divided
    by Σ w over the whole sequences and multiplied by the CP size, so that the engine's mean over the CP ranks is
    the whole weighted MSE. ``pred``/``target`` ``[b, tokens / cp, features]``; ``weight [b, tokens]`` (whole)."""
    err = (pred.float() - target.float()).pow(2).mean(-1)
    local = shard_sequence(weight.to(err.dtype), groups, dim=1)
    return (err * local).sum() * groups.size / weight.sum().clamp_min(1)


__all__ = ["MASK_CHANNELS", "channel_input", "check_conditioning", "check_shard_conditioning", "condition_latent",
           "condition_sample", "first_frame_tokens", "frame_mask", "image_kind", "last_frame_too", "latent_input",
           "synthetic_image_features", "weighted_mse"]
