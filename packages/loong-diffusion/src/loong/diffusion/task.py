"""``diffusion.wan``: flow-matching training of a Wan transformer on the fsdp engine.

Sample ``i`` of the stream is clip ``i % data.num_clips`` of the synthetic set with the noise, σ and text dropout
that :func:`~loong.diffusion.flow.flow_sample` draws for (``train.seed``, ``i``): a pure function of the index, so
every layout reads the same samples and a resumed run continues exactly. The ranks of one context-parallel group
read the same samples; each predicts its contiguous shard of the video tokens (``WanTransformer.forward_shard``)
and takes the MSE against the same shard of the target, and the engine averages those equal-sized shard losses.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Iterator, Sequence
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
from loong.diffusion.conditioning import check_conditioning, condition_sample, image_kind, weighted_mse
from loong.diffusion.convert import split_modules, write_diffusers
from loong.diffusion.data.shards import BucketOrder, LatentShards, check_shards
from loong.diffusion.data.synthetic import MovingShapes
from loong.diffusion.experts import EXPERTS, Expert, ExpertPair, expert_range, step_expert
from loong.diffusion.flow import flow_sample
from loong.diffusion.models.wan import WanConfig, WanTransformer
from loong.diffusion.models.wan.mapping import (
    check_diffusers_weights,
    config_to_diffusers,
    from_diffusers,
    read_diffusers_folder,
)
from loong.diffusion.models.wan.model import to_patches
from loong.diffusion.packing import ClipPacker, PackedPrediction, check_packing, clip_cost_model, packed_loss
from loong.diffusion.training_preview import check_preview, write_preview

#: the stream offset of evaluation samples: far from any training index, so they get fresh noise and σ
EVAL_OFFSET = 10**7

#: torch 2.11's inductor fuses a norm's backward reductions over the hidden and the token dimension into one
#: "mix-order" kernel; at one clip a micro-batch (a [1, 1, dim] modulation broadcast over 32K tokens) that kernel
#: gave the modulation gradients 10% off fp32 on an H200 where eager bf16 is 0.4% off; with it off, 0.5%
#: (benchmarks/wan_compile_check.py, docs/performance.md's Wan section).
COMPILE_OPTIONS: dict[str, Any] = {"triton.mix_order_reduction": False}


def clip_tokens(shape: Sequence[int], patch_size: Sequence[int]) -> int:
    """Tokens of a latent clip of ``shape`` ``(f, h, w)`` after patching."""
    return math.prod(size // patch for size, patch in zip(shape, patch_size, strict=True))


def compute_dtype(wan: WanTransformer) -> torch.dtype:
    """The dtype the model computes in now (under FSDP2 mixed precision, its unsharded bf16 parameters')."""
    return wan.patch_embed.weight.dtype


class ShardPrediction(nn.Module):
    """The trained module: ``forward`` is the Wan model's ``forward_shard`` (this CP rank's predicted tokens).

    The engine's wrappers (FSDP2's root unsharding, DDP's gradient sync) hook a module's ``forward``; calling
    ``forward_shard`` on the bare model would bypass them, so the sharded prediction is this module's forward.
    """

    def __init__(self, wan: WanTransformer) -> None:
        super().__init__()
        self.wan = wan

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                image: torch.Tensor | None = None) -> torch.Tensor:
        # the engine leaves the inputs as they come (WanTask.cast_root_inputs): the timestep stays fp32, as
        # diffusers' pipelines feed it; the rest take the compute dtype
        dtype = compute_dtype(self.wan)
        return self.wan.forward_shard(latents.to(dtype), timestep.float(), text.to(dtype),
                                      None if image is None else image.to(dtype))


@TASKS.register("diffusion.wan")
class WanTask(FSDPTask):
    """Text-to-video flow matching of ``model`` (a :class:`~loong.diffusion.schema.WanModelConfig`) on ``data``."""

    #: timesteps reach the model in fp32 (bf16 would round 999.3 to 1000); the prediction modules cast the rest
    cast_root_inputs = False

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        wan, d = cfg.model.wan(), cfg.data
        check_conditioning(cfg, wan)
        check_preview(cfg, wan)
        if d.source == "shards":  # the clips' shapes come from the shards' buckets, not data.frames/height/width
            shards = LatentShards(d.path, d.text_len)
            # packs are padded to the CP size, so packed buckets need not divide by it
            check_shards(shards, channels=wan.out_channels, text_dim=wan.text_dim, patch_size=wan.patch_size,
                         text_len=d.text_len, cp=1 if d.pack_tokens else cfg.parallel.cp_ulysses * cfg.parallel.cp_ring,
                         preset=cfg.model.preset)
            if d.pack_tokens:
                check_packing(cfg, max(clip_tokens(r.latent_shape[1:], wan.patch_size) for r in shards.records))
            return
        if d.sizes is None:
            for key, size, patch in zip(("frames", "height", "width"), (d.frames, d.height, d.width),
                                        wan.patch_size, strict=True):
                if size % patch:
                    raise LoongError(f"data.{key}={size} must divide by the model's patch size {patch} "
                                     f"(model.patch_size={list(wan.patch_size)})")
        for i, size in enumerate(d.sizes or []):
            if any(n % p for n, p in zip(size, wan.patch_size, strict=True)):
                raise LoongError(f"data.sizes[{i}]={list(size)}: frames, height and width must divide by the "
                                 f"model's patch size (model.patch_size={list(wan.patch_size)})")
        cp = cfg.parallel.cp_ulysses * cfg.parallel.cp_ring
        tokens = [clip_tokens(size, wan.patch_size) for size in d.latent_sizes()]
        if d.pack_tokens:
            check_packing(cfg, max(tokens))
            return
        if len(set(d.latent_sizes())) > 1 and cfg.train.micro_batch_size > 1:
            raise LoongError(f"data.sizes holds several sizes, and clips of different sizes cannot stack into one "
                             f"micro-batch of train.micro_batch_size={cfg.train.micro_batch_size}; pack them "
                             f"(data.pack_tokens=N, N >= {max(tokens)}) or set train.micro_batch_size=1")
        for size, n in zip(d.latent_sizes(), tokens, strict=True):
            if n % cp:
                where = "data.frames/height/width" if d.sizes is None else f"data.sizes entry {list(size)}"
                raise LoongError(f"{where} give(s) {n} video tokens, which do not divide by the context-parallel "
                                 f"size {cp} (parallel.cp_ulysses × parallel.cp_ring); or pack with "
                                 "data.pack_tokens, which pads each pack")

    # --- data --------------------------------------------------------------------------------
    def setup_data(self) -> None:
        t, d = self.cfg.train, self.cfg.data
        self.wan = self.cfg.model.wan()
        self.gbs, self.mbs = t.global_batch_size, t.micro_batch_size
        if d.source == "shards":
            self.dataset = LatentShards(d.path, d.text_len)
            # each global batch one bucket; evaluation walks its own shuffle, so that it starts at a bucket boundary
            self.order = BucketOrder(self.dataset.bucket_of, self.gbs, t.seed)
            self.eval_order = BucketOrder(self.dataset.bucket_of, self.gbs, t.seed + 1)
            self.tokens = round(statistics.mean(clip_tokens(r.latent_shape[1:], self.wan.patch_size)
                                                for r in self.dataset.records))  # the accounting's mean
            return
        self.tokens = round(statistics.mean(self._size_tokens()))  # each size equally likely
        self.dataset = MovingShapes(num_clips=d.num_clips, num_classes=d.num_classes, channels=self.wan.out_channels,
                                    frames=d.frames, height=d.height, width=d.width, text_len=d.text_len,
                                    text_dim=self.wan.text_dim, seed=d.seed, sizes=d.latent_sizes())

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        """Stream sample ``index``: ``noisy`` latents, ``target``, ``timestep`` (``[tokens]`` for per-token
        timestep models) and ``text``."""
        t = self.cfg.train
        clip = self.dataset.clip(self._clip_index(index))
        s = flow_sample(clip["latents"], clip["text"], t.seed, index, sampling=t.timestep_sampling,
                        shift=t.timestep_shift, logit_mean=t.logit_mean, logit_std=t.logit_std,
                        text_drop_prob=self.cfg.data.text_drop_prob,
                        sigma_range=expert_range(self.wan, self._expert_of(index)))
        tokens = clip_tokens(clip["latents"].shape[1:], self.wan.patch_size)  # shard clips differ by bucket
        timestep = s["timestep"].expand(tokens) if self.wan.expand_timesteps else s["timestep"]
        sample = {"noisy": s["noisy"], "target": s["target"], "timestep": timestep, "text": s["text"]}
        if image_kind(self.wan) != "none":
            sample.update(condition_sample(self.wan, self.cfg, clip, s, index, self._label(index)))
        return sample

    def _label(self, index: int) -> int | None:
        """The synthetic class of stream sample ``index`` (None for shards): it seeds the synthetic image features."""
        return None if self.cfg.data.source == "shards" else self.dataset.class_of(index % len(self.dataset))

    def _step_of(self, index: int) -> int:
        """The step stream of sample ``index``: training steps from 0, evaluation steps from ``EVAL_OFFSET``."""
        base = 0 if index < EVAL_OFFSET else EVAL_OFFSET
        return base + (index - base) // self.gbs

    def _expert_of(self, index: int) -> Expert | None:
        """The A14B expert that trains on sample ``index`` (``model.expert``, or for ``both`` its step's draw);
        None for a one-expert model."""
        if self.wan.experts == 1:
            return None
        if self.cfg.model.expert != "both":
            return self.cfg.model.expert
        return step_expert(self.wan, self.cfg.train, self._step_of(index))

    def _clip_index(self, index: int) -> int:
        """The clip of stream sample ``index``: itself for synthetic data (which wraps around), else the bucket
        order's pick (training and evaluation samples each from their own order)."""
        if self.cfg.data.source != "shards":
            return index
        return self.order(index) if index < EVAL_OFFSET else self.eval_order(index - EVAL_OFFSET)

    def _size_tokens(self) -> list[int]:
        """Video tokens of each clip size the data holds, by frequency (the accounting's distribution)."""
        if self.cfg.data.source == "shards":
            return [clip_tokens(r.latent_shape[1:], self.wan.patch_size) for r in self.dataset.records]
        return [clip_tokens(size, self.wan.patch_size) for size in self.cfg.data.latent_sizes()]

    def _tokens_of(self, index: int) -> int:
        """Video tokens of stream sample ``index``, from its clip's size without reading the clip (the plan of a
        packed step needs every clip's size on every rank)."""
        if self.cfg.data.source == "shards":
            shape = self.dataset.records[self._clip_index(index)].latent_shape[1:]
        else:
            shape = self.dataset.size_of(index)
        return clip_tokens(shape, self.wan.patch_size)

    @functools.cached_property
    def packer(self) -> ClipPacker | None:
        """The packed micro-batches of this DP rank (``data.pack_tokens`` > 0, :mod:`loong.diffusion.packing`),
        else None."""
        t, d = self.cfg.train, self.cfg.data
        if not d.pack_tokens:
            return None
        return ClipPacker(self.sample, self._tokens_of, global_batch_size=self.gbs, dp=self.layout.dp,
                          dp_rank=self.layout.dp_rank, cp=self.layout.cp_groups.size,
                          default_micro_batches=self.gbs // (self.mbs * self.layout.dp), pack_tokens=d.pack_tokens,
                          cost=clip_cost_model(self.wan, d.text_len), seed=t.seed, patch_size=self.wan.patch_size)

    def num_eval_microbatches(self, index: int, default: int) -> int:
        return self.packer.plan(EVAL_OFFSET + index * self.gbs, train=False).num_micro_batches if self.packer \
            else default

    def num_train_microbatches(self, step: int, default: int) -> int:
        return self.packer.plan(step * self.gbs).num_micro_batches if self.packer else default

    def after_train_step(self, step: int, extra: dict[str, float]) -> dict[str, float]:
        metrics = super().after_train_step(step, extra)
        if self.packer:
            metrics.update(self.packer.metrics(step * self.gbs))
        interval = self.cfg.train.preview_interval
        if interval and (step + 1) % interval == 0:  # ``step`` counts from 0: after step + 1 optimiser steps
            write_preview(self, self.trained, step + 1)
        return metrics

    def _batches(self, offset: int, step: int, num_microbatches: int) -> Iterator[dict]:
        if self.packer:
            return self.packer.micro_batches(offset + step * self.gbs, train=offset == 0)
        batches = rank_microbatches(self.sample, offset + step * self.gbs, self.gbs, self.layout.dp,
                                    self.layout.dp_rank, num_microbatches)
        if self.wan.experts == 1 or self.cfg.model.expert != "both":
            return batches
        expert = step_expert(self.wan, self.cfg.train, offset + step)  # the step's expert routes every micro-batch
        return ({**batch, "expert": expert} for batch in batches)

    def train_microbatches(self, step: int, num_microbatches: int) -> Iterator[dict]:
        return self._batches(0, step, num_microbatches)

    def eval_microbatches(self, index: int, num_microbatches: int) -> Iterator[dict]:
        return self._batches(EVAL_OFFSET, index, num_microbatches)

    # --- model and loss ----------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        self.trained = self._trained_module()  # kept for the previews: the engine shards this very module in place
        return self.trained

    def compile_options(self) -> dict[str, Any]:
        return dict(COMPILE_OPTIONS)

    def _trained_module(self) -> nn.Module:
        if self.wan.experts == 2 and self.cfg.model.expert == "both":
            return ExpertPair(*(ShardPrediction(self._transformer()) for _ in EXPERTS))
        wan = self._transformer()
        return PackedPrediction(wan) if self.cfg.data.pack_tokens else ShardPrediction(wan)

    def _transformer(self) -> WanTransformer:
        # under train.compile inductor fuses the norms and RoPE; the Triton kernels would break each block's graph
        return WanTransformer(self.wan, self.layout.cp_groups, self.accelerator.capabilities(),
                              fused_kernels=not self.cfg.train.compile)

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
        check_diffusers_weights(path, self.wan, weights)
        model.wan.load_state_dict(from_diffusers(weights), strict=True)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        if isinstance(model, ExpertPair):
            return [block for name in EXPERTS for block in getattr(model, name).wan.blocks]
        return list(model.wan.blocks)

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        if self.packer:  # a pack's weighted squared error: the engine's mean is the clips' mean MSE
            return packed_loss(model, batch, self.layout.cp_groups), {}
        route = {"expert": batch["expert"]} if "expert" in batch else {}
        pred = model(batch["noisy"], batch["timestep"], batch["text"], batch.get("image"), **route)
        target = shard_sequence(to_tokens(batch["target"], self.wan), self.layout.cp_groups, dim=1)
        if "weight" in batch:  # TI2V: the conditioning frame's tokens leave the loss
            return weighted_mse(pred, target, batch["weight"], self.layout.cp_groups), {}
        return F.mse_loss(pred.float(), target.float()), {}

    def export(self, model: nn.Module, out_dir: Path) -> Path | None:
        """``train.save_hf`` / ``train.save_diffusers``: the trained weights (``train.export_ema``: their moving
        averages, which the engine has put in place) as a diffusers ``WanTransformer3DModel`` folder ``out_dir``,
        both A14B experts as ``out_dir/transformer`` and ``out_dir/transformer_2``, as ``convert`` writes a
        checkpoint (collective: every rank gathers, the logging rank writes)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0 only
        state = get_model_state_dict(model, options=options)
        if not self.layout.is_logging_rank:
            return None
        return write_diffusers(split_modules(state), self.wan, out_dir)

    # --- accounting --------------------------------------------------------------------------
    def tokens_per_step(self) -> int:
        return self.gbs * self.tokens

    def flops_per_token(self) -> float:
        """Approximate training FLOPs per video token: 6 × parameters (every weight multiplies each token once
        forward, twice backward) plus attention's score and value products, 12 × layers × width × (video tokens
        + text tokens) (self- and cross-attention; the text embedder's per-text-token work is left out). Mixed
        sizes attend over their own clip: a token of a clip of ``n`` sees ``n``, so the mean is Σn² / Σn."""
        w, sizes = self.wan, self._size_tokens()
        attended = sum(n * n for n in sizes) / sum(sizes)
        return 6.0 * w.num_parameters(active=True) + 12.0 * w.num_layers * w.dim * (attended + self.cfg.data.text_len)


def to_tokens(target: torch.Tensor, wan: WanConfig) -> torch.Tensor:
    """``[b, c, F, H, W]`` → the head's token layout ``[b, tokens, pt·ph·pw·c]`` (``WanTransformer.patchify``)."""
    return to_patches(target, wan.patch_size, channels_last=True)


__all__ = ["EVAL_OFFSET", "ShardPrediction", "WanTask", "clip_tokens", "to_tokens"]
