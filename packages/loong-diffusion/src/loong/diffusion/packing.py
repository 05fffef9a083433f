"""Packed training of the ``diffusion.wan`` task (``data.pack_tokens`` > 0): a micro-batch is a token budget.

Each step's global batch (the same ``global_batch_size`` stream samples as without packing) is planned by the core
balancer (:class:`~loong.core.balance.DataBalancer`, which runs :func:`~loong.core.balance.plan`): the clips are
assigned to data-parallel ranks so that the most loaded rank is as cheap as possible under an attention-aware cost
(:func:`clip_cost_model`: quadratic in a clip's video tokens), then cut into micro-batches of at most
``data.pack_tokens`` video tokens, at least ``global_batch_size / (micro_batch_size × dp)`` of them, the same
number on every rank. The plan depends only on (``train.seed``, step) and the clips' sizes, so every rank computes
the same one without communication and a resumed run replans exactly. Each micro-batch is one sequence
(:func:`~loong.diffusion.models.wan.packed.pack_clips`), padded to a multiple of the context-parallel size; a rank
with fewer clips than micro-batches packs the step's smallest clip with weight 0 (it runs the collectives; its
loss and gradients are zero).

**Loss weighting: the clip mean.** The step's loss is the mean over the global batch's ``N`` clips of each clip's
own MSE (over its tokens and channels), what an unpacked run gives (its micro-batch MSE over equal-sized clips is
that mean). The engine averages micro-batch losses equally over ``nmb`` micro-batches and ``dp × cp`` ranks, so a
clip's tokens carry the weight ``dp · cp · nmb / (N · tokens_i · channels)`` and a micro-batch's loss is its
weighted squared-error sum (:func:`~loong.diffusion.models.wan.packed.packed_mse`); the engine's mean is then
``(1/N) Σ_i MSE_i``, whatever the plan. (Weighting by tokens instead would let large clips dominate the step.)

Evaluation plans the same way without the token budget: the engine runs its fixed number of micro-batches there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from loong.core.attention import CPGroups, shard_sequence
from loong.core.balance import CostModel, DataBalancer, StepPlan
from loong.core.errors import LoongError
from loong.diffusion.models.wan import PACK_INPUTS, WanConfig, WanTransformer, pack_clips, packed_mse


def check_packing(cfg: Any, largest_clip: int) -> None:
    """The config checks of packing: every clip (the largest has ``largest_clip`` video tokens) must fit one
    micro-batch's budget. Context parallelism combines with packing: a pack is padded to a multiple of the CP
    size and sharded like any sequence."""
    if cfg.data.pack_tokens < largest_clip:
        raise LoongError(f"data.pack_tokens={cfg.data.pack_tokens} is less than the largest clip's {largest_clip} "
                         f"video tokens (data.sizes, or data.frames/height/width, after patching); set "
                         f"data.pack_tokens >= {largest_clip}")


def clip_cost_model(wan: WanConfig, text_len: int) -> CostModel:
    """Training FLOPs of one clip of ``n`` video tokens, ``a·n² + b·n``: self-attention's score and value products
    ``12·layers·dim·n²`` (forward and backward), the weights ``6·parameters·n`` and cross-attention to
    ``text_len`` text tokens ``12·layers·dim·text_len·n``."""
    attention = 12.0 * wan.num_layers * wan.dim
    return CostModel(a=attention, b=6.0 * wan.num_parameters(active=True) + attention * text_len)


class PackedPrediction(nn.Module):
    """The trained module of a packed run: ``forward`` is the Wan model's ``forward_packed`` (this CP rank's
    predicted tokens of one pack), so that the engine's wrappers, which hook ``forward``, see the call."""

    def __init__(self, wan: WanTransformer) -> None:
        super().__init__()
        self.wan = wan

    def forward(self, patches: torch.Tensor, positions: torch.Tensor, doc_ids: torch.Tensor, timesteps: torch.Tensor,
                timestep_index: torch.Tensor, text: torch.Tensor, text_doc_ids: torch.Tensor,
                image: torch.Tensor | None = None) -> torch.Tensor:
        dtype = self.wan.patch_embed.weight.dtype  # see ShardPrediction: timesteps stay fp32
        return self.wan.forward_packed(patches.to(dtype), positions, doc_ids, timesteps.float(), timestep_index,
                                       text.to(dtype), text_doc_ids, None if image is None else image.to(dtype))


def packed_loss(model: nn.Module, batch: dict[str, torch.Tensor], groups: CPGroups) -> torch.Tensor:
    """A packed micro-batch's loss on this CP rank: the weighted squared error of its predicted tokens against the
    same shard of the target (the weights in the module docstring)."""
    pred = model(**{k: batch[k] for k in PACK_INPUTS if k in batch})
    target = shard_sequence(batch["target"], groups, dim=1)
    weight = shard_sequence(batch["token_weight"], groups, dim=1)
    return packed_mse(pred, target, weight)


class ClipPacker:
    """The packed micro-batches of one DP rank, from a step's plan.

    ``sample(i)``: stream sample ``i`` (``noisy``, ``target``, ``timestep``, ``text``, optionally ``image`` and a
    per-token loss ``weight``, which makes that clip's MSE the weighted one); ``tokens_of(i)``: its video tokens,
    known without reading it (the plan needs every clip's size on every rank).
    """

    def __init__(self, sample: Callable[[int], dict[str, torch.Tensor]], tokens_of: Callable[[int], int], *,
                 global_batch_size: int, dp: int, dp_rank: int, cp: int, default_micro_batches: int,
                 pack_tokens: int, cost: CostModel, seed: int, patch_size: Sequence[int]) -> None:
        self.sample, self.tokens_of = sample, tokens_of
        self.gbs, self.dp, self.dp_rank, self.cp = global_batch_size, dp, dp_rank, cp
        self.default_micro_batches, self.pack_tokens = default_micro_batches, pack_tokens
        self.patch_size = tuple(patch_size)
        self.balancer = DataBalancer("flops", cost, dp, seed)
        self._cached: tuple[tuple[int, bool], StepPlan] | None = None

    def plan(self, first: int, train: bool = True) -> StepPlan:
        """The plan of the global batch of samples ``first .. first + global_batch_size − 1`` (cached): positions
        into that batch by rank and micro-batch, each within the token budget (``train``: the key of the cache;
        evaluation batches plan alike)."""
        key = (first, train)
        if self._cached is None or self._cached[0] != key:
            lengths = [self.tokens_of(first + j) for j in range(self.gbs)]
            if max(lengths) > self.pack_tokens:  # data whose sizes check_packing could not see (shards)
                raise LoongError(f"data.pack_tokens={self.pack_tokens}: sample {first + lengths.index(max(lengths))} "
                                 f"has {max(lengths)} video tokens, more than one micro-batch holds")
            per_rank = self.gbs // self.dp
            step_plan = self.balancer.plan_step(first, lengths, [j // per_rank for j in range(self.gbs)],
                                                self.default_micro_batches,
                                                capacity=self.pack_tokens)
            self._cached = (key, step_plan)
        return self._cached[1]

    def micro_batches(self, first: int, train: bool = True) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's packed micro-batches of the global batch starting at sample ``first``."""
        step_plan = self.plan(first, train)
        nmb = step_plan.num_micro_batches
        weight = self.dp * self.cp * nmb / self.gbs  # see the module docstring: the engine's mean is the clip mean
        for positions in step_plan.micro_batches[self.dp_rank]:
            if positions:
                yield self._pack([first + p for p in positions], [weight] * len(positions))
            else:  # the step's smallest clip, weighing nothing: this rank still runs the step's collectives
                smallest = min(range(self.gbs), key=lambda j: (int(step_plan.lengths[j]), j))
                yield self._pack([first + smallest], [0.0])

    def _pack(self, indices: list[int], weights: list[float]) -> dict[str, torch.Tensor]:
        samples = [self.sample(i) for i in indices]
        images = [s["image"] for s in samples] if "image" in samples[0] else None
        pack = pack_clips([s["noisy"] for s in samples], [s["timestep"] for s in samples],
                          [s["text"] for s in samples], self.patch_size, images=images,
                          targets=[s["target"] for s in samples], weights=weights,
                          token_masks=[s.get("weight") for s in samples], multiple=self.cp)
        del pack["grids"]  # the loss needs no clip shapes
        return pack

    def metrics(self, first: int) -> dict[str, Any]:
        """The plan's figures for the step's log: predicted max/mean rank cost before and after balancing,
        micro-batches per rank and how full the token budgets are (real tokens over ``dp × nmb × pack_tokens``)."""
        step_plan = self.plan(first)
        fill = float(step_plan.lengths.sum()) / (self.dp * step_plan.num_micro_batches * self.pack_tokens)
        return {"balance_before": round(step_plan.before, 4), "balance_after": round(step_plan.after, 4),
                "micro_batches": step_plan.num_micro_batches, "pack_fill": round(fill, 4)}


__all__ = ["ClipPacker", "PackedPrediction", "check_packing", "clip_cost_model", "packed_loss"]
