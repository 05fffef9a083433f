"""``diffusion.wan``: flow-matching training of a Wan transformer on the fsdp engine.

Sample ``i`` of the stream is clip ``i % data.num_clips`` of the synthetic set with the noise, σ and text dropout
that :func:`~loong.diffusion.flow.flow_sample` draws for (``train.seed``, ``i``): a pure function of the index, so
every layout reads the same samples and a resumed run continues exactly. The ranks of one context-parallel group
read the same samples; each predicts its contiguous shard of the video tokens (``WanTransformer.forward_shard``)
and takes the MSE against the same shard of the target, and the engine averages those equal-sized shard losses.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from loong.core.attention import shard_sequence
from loong.core.data import rank_microbatches
from loong.core.engines.fsdp.task import FSDPTask
from loong.core.errors import LoongError
from loong.core.registry import TASKS
from loong.diffusion.data.synthetic import MovingShapes
from loong.diffusion.flow import flow_sample
from loong.diffusion.models.wan import WanConfig, WanTransformer, save_diffusers
from loong.diffusion.models.wan.mapping import config_to_diffusers, from_diffusers, read_diffusers_folder
from loong.diffusion.models.wan.model import to_patches

#: the stream offset of evaluation samples: far from any training index, so they get fresh noise and σ
EVAL_OFFSET = 10**7


def video_tokens(cfg: Any, wan: WanConfig) -> int:
    """Tokens of one synthetic clip after patching."""
    d = cfg.data
    pt, ph, pw = wan.patch_size
    return (d.frames // pt) * (d.height // ph) * (d.width // pw)


class ShardPrediction(nn.Module):
    """The trained module: ``forward`` is the Wan model's ``forward_shard`` (this CP rank's predicted tokens).

    The engine's wrappers (FSDP2's root unsharding, DDP's gradient sync) hook a module's ``forward``; calling
    ``forward_shard`` on the bare model would bypass them, so the sharded prediction is this module's forward.
    """

    def __init__(self, wan: WanTransformer) -> None:
        super().__init__()
        self.wan = wan

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        return self.wan.forward_shard(latents, timestep, text)


@TASKS.register("diffusion.wan")
class WanTask(FSDPTask):
    """Text-to-video flow matching of ``model`` (a :class:`~loong.diffusion.schema.WanModelConfig`) on ``data``."""

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        wan, d = cfg.model.wan(), cfg.data
        if wan.image_dim is not None or wan.in_channels != wan.out_channels:
            raise LoongError(f"model.preset={cfg.model.preset}: the synthetic data trains text-to-video (in_channels "
                             f"= out_channels, no image branch); this model has in_channels={wan.in_channels}, "
                             f"out_channels={wan.out_channels}, image_dim={wan.image_dim}")
        for key, size, patch in zip(("frames", "height", "width"), (d.frames, d.height, d.width), wan.patch_size,
                                    strict=True):
            if size % patch:
                raise LoongError(f"data.{key}={size} must divide by the model's patch size {patch} "
                                 f"(model.patch_size={list(wan.patch_size)})")
        cp = cfg.parallel.cp_ulysses * cfg.parallel.cp_ring
        if video_tokens(cfg, wan) % cp:
            raise LoongError(f"data.frames/height/width give {video_tokens(cfg, wan)} video tokens, which do not "
                             f"divide by the context-parallel size {cp} (parallel.cp_ulysses × parallel.cp_ring)")

    # --- data --------------------------------------------------------------------------------
    def setup_data(self) -> None:
        t, d = self.cfg.train, self.cfg.data
        self.wan = self.cfg.model.wan()
        self.gbs, self.mbs = t.global_batch_size, t.micro_batch_size
        self.tokens = video_tokens(self.cfg, self.wan)
        self.dataset = MovingShapes(num_clips=d.num_clips, num_classes=d.num_classes, channels=self.wan.out_channels,
                                    frames=d.frames, height=d.height, width=d.width, text_len=d.text_len,
                                    text_dim=self.wan.text_dim, seed=d.seed)

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        """Stream sample ``index``: ``noisy`` latents, ``target``, ``timestep`` (``[tokens]`` for per-token
        timestep models) and ``text``."""
        t = self.cfg.train
        clip = self.dataset.clip(index)
        s = flow_sample(clip["latents"], clip["text"], t.seed, index, sampling=t.timestep_sampling,
                        shift=t.timestep_shift, logit_mean=t.logit_mean, logit_std=t.logit_std,
                        text_drop_prob=self.cfg.data.text_drop_prob)
        timestep = s["timestep"].expand(self.tokens) if self.wan.expand_timesteps else s["timestep"]
        return {"noisy": s["noisy"], "target": s["target"], "timestep": timestep, "text": s["text"]}

    def _batches(self, offset: int, step: int, num_microbatches: int) -> Iterator[dict]:
        return rank_microbatches(self.sample, offset + step * self.gbs, self.gbs, self.layout.dp, self.layout.dp_rank,
                                 num_microbatches)

    def train_microbatches(self, step: int, num_microbatches: int) -> Iterator[dict]:
        return self._batches(0, step, num_microbatches)

    def eval_microbatches(self, index: int, num_microbatches: int) -> Iterator[dict]:
        return self._batches(EVAL_OFFSET, index, num_microbatches)

    # --- model and loss ----------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        return ShardPrediction(WanTransformer(self.wan, self.layout.cp_groups, self.accelerator.capabilities()))

    def init_weights(self, model: nn.Module) -> None:
        path = self.cfg.model.init_from_diffusers
        if path is None:
            return
        raw, weights = read_diffusers_folder(path)
        expected = config_to_diffusers(self.wan)
        differ = sorted(k for k in expected if raw.get(k) != expected[k] and not k.startswith("_"))
        if differ:
            raise LoongError(f"model.init_from_diffusers: {path} holds another shape ({', '.join(differ)} differ "
                             f"from model.preset={self.cfg.model.preset} and its overrides)")
        model.wan.load_state_dict(from_diffusers(weights), strict=True)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.wan.blocks)

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        pred = model(batch["noisy"], batch["timestep"], batch["text"])
        target = shard_sequence(to_tokens(batch["target"], self.wan), self.layout.cp_groups, dim=1)
        return F.mse_loss(pred.float(), target.float()), {}

    def export(self, model: nn.Module, out_dir: Path) -> Path | None:
        """``train.save_hf``: the trained weights as a diffusers ``WanTransformer3DModel`` folder ``out_dir``
        (collective: every rank gathers, the logging rank writes)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0 only
        state = get_model_state_dict(model, options=options)
        if not self.layout.is_logging_rank:
            return None
        wan = {key.removeprefix("wan."): value for key, value in state.items()}
        return save_diffusers(wan, self.wan, out_dir)

    # --- accounting --------------------------------------------------------------------------
    def tokens_per_step(self) -> int:
        return self.gbs * self.tokens

    def flops_per_token(self) -> float:
        """Approximate training FLOPs per video token: 6 × parameters (every weight multiplies each token once
        forward, twice backward) plus attention's score and value products, 12 × layers × width × (video tokens
        + text tokens) (self- and cross-attention; the text embedder's per-text-token work is left out)."""
        w = self.wan
        return 6.0 * w.num_parameters(active=True) + 12.0 * w.num_layers * w.dim * (self.tokens + self.cfg.data.text_len)


def to_tokens(target: torch.Tensor, wan: WanConfig) -> torch.Tensor:
    """``[b, c, F, H, W]`` → the head's token layout ``[b, tokens, pt·ph·pw·c]`` (``WanTransformer.patchify``)."""
    return to_patches(target, wan.patch_size, channels_last=True)


__all__ = ["EVAL_OFFSET", "ShardPrediction", "WanTask", "to_tokens", "video_tokens"]
