"""Data-parallel balancing of VLM samples (``data.balance.enabled=true``), as loong-llm's SFT balancing
(:mod:`loong.llm.sft.balance`) with the vision tower's cost added.

The global batch of a step is what it is without balancing: the ``global_batch_size`` packed rows the sampler
picks. Balancing redistributes their *samples*: the core planner (:class:`loong.core.balance.DataBalancer`) gives
each data-parallel rank a set of samples of about equal cost and splits them into micro-batches of at most
``micro_batch_size * seq_length`` real tokens; each micro-batch is laid out as rows (best-fit packed with
``data.packing``, else one sample a row) trimmed to its longest row, rounded up to loong-llm's ``row_multiple``
(8, and what the foundation's sequence parallelism splits every row into). The loss is the per-token mean over the
same assistant tokens, so only the summation order changes.

A sample's cost is ``a·len² + b·len + c`` for the foundation (its tokens, placeholders included) plus
``enc_a·n² + enc_b·n`` for the vision tower over its ``n`` encoder tokens (patches; InternVL: every tile's
patches and CLS token). With ``cost=flops`` the coefficients are training FLOPs: the foundation's as loong-llm's
SFT, the tower's 3 × its family's forward :func:`encoder_cost` (``quadratic·n² + linear·n`` of one attention
group). The ViT attends within each image (each video frame, each tile), so charging the quadratic term on a
sample's total ``n`` over-states samples of several images or frames; the linear term, which dominates at
published widths, is exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import Dataset

from loong.core.balance import CostModel, DataBalancer, StepPlan
from loong.llm.data.text import GlobalBatchSampler
from loong.llm.sft.balance import conversation_cost_model, row_multiple, trimmed_length
from loong.llm.sft.packing import pack_best_fit
from loong.vlm.data.dataset import VisionSFTDataset, vision_loader
from loong.vlm.data.encode import EncodedSample
from loong.vlm.models.config import EncoderConfig
from loong.vlm.models.families import vision_family

#: plans kept for recent steps (the loader's schedule may run a step or two ahead of the task)
PLAN_CACHE = 4


def encoder_tokens(sample: EncodedSample, enc: EncoderConfig) -> int:
    """Tokens the vision tower runs over for ``sample``: Qwen ``Σ t·h·w`` patches; InternVL tiles × (patches of
    a tile + its CLS token)."""
    if enc.family == "intern_vit":
        per_tile = (enc.image_size // enc.patch_size) ** 2 + 1
        return sum(m.grid[0] * per_tile for m in sample.media)
    return sum(m.grid[0] * m.grid[1] * m.grid[2] for m in sample.media)


def vision_cost_model(cfg: Any) -> CostModel:
    """Training FLOPs of one sample: the foundation's (:func:`~loong.llm.sft.balance.conversation_cost_model`)
    and 3 × the encoder family's forward ``encoder_cost`` for the ``enc_a``/``enc_b`` terms."""
    text = conversation_cost_model(cfg.foundation)
    vit = vision_family(cfg.encoder.family).load().encoder_cost(cfg.encoder)
    return CostModel(a=text.a, b=text.b, c=text.c, enc_a=3.0 * vit.quadratic, enc_b=3.0 * vit.linear)


@dataclass
class _Rows:
    """The part of :class:`~loong.vlm.data.packing.PackedVisionSequences` a :class:`VisionSFTDataset` reads:
    here one row of chosen samples at a chosen length."""

    samples: list[EncodedSample]
    bins: list[list[int]]
    seq_length: int
    pad_id: int


class BalancedRows(Dataset):
    """Rows named by key ``(sample ids, length)``: those samples of ``base`` packed into one row of ``length``
    slots, media decoded as :class:`VisionSFTDataset` does (in the DataLoader worker that asks)."""

    def __init__(self, base: VisionSFTDataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key: tuple[tuple[int, ...], int]) -> dict[str, Any]:
        ids, length = key
        b = self.base
        row = _Rows(b.packed.samples, [list(ids)], length, b.packed.pad_id)
        return VisionSFTDataset(row, b.processor, b.scheme, b.on_error)[0]  # type: ignore[arg-type]


class BalancedVisionSamples:
    """Each step's plan (the same on every rank) and this rank's micro-batches of rows."""

    def __init__(self, cfg: Any, data: VisionSFTDataset, sampler: GlobalBatchSampler, dp_size: int,
                 dp_group: Any) -> None:
        t, b = cfg.train, cfg.data.balance
        self.data, self.packed, self.sampler = data, data.packed, sampler
        self.gbs, self.mbs, self.seq_length = t.global_batch_size, t.micro_batch_size, t.seq_length
        self.packing = cfg.data.packing
        self.row_multiple = row_multiple(cfg.foundation, cfg.parallel)  # the foundation's sequence split too
        self.default_micro_batches = t.global_batch_size // (t.micro_batch_size * dp_size)
        self.encoder = [encoder_tokens(s, cfg.encoder) for s in self.packed.samples]
        self.balancer = DataBalancer(b.cost, vision_cost_model(cfg), dp_size, t.seed, fit_steps=b.fit_steps,
                                     dp_group=dp_group)
        self._plans: dict[int, tuple[StepPlan, list[int]]] = {}

    def plan(self, step: int) -> tuple[StepPlan, list[int]]:
        """The step's plan and its samples (indices into the packed samples, by plan position)."""
        if step in self._plans:
            return self._plans[step]
        rows = [self.sampler.index(g) for g in range(step * self.gbs, (step + 1) * self.gbs)]
        samples: list[int] = []
        default_ranks: list[int] = []
        rows_per_rank = self.default_micro_batches * self.mbs
        for k, row in enumerate(rows):
            samples.extend(self.packed.bins[row])
            default_ranks.extend([k // rows_per_rank] * len(self.packed.bins[row]))
        lengths = [len(self.packed.samples[s]) - 1 for s in samples]
        step_plan = self.balancer.plan_step(step, lengths, default_ranks, self.default_micro_batches,
                                            capacity=self.mbs * self.seq_length,
                                            encoder_lengths=[self.encoder[s] for s in samples])
        self._plans[step] = (step_plan, samples)
        for old in sorted(self._plans)[:-PLAN_CACHE]:
            del self._plans[old]
        return step_plan, samples

    def loss_tokens(self, step: int) -> int:
        """Assistant tokens of the whole global batch (the per-token mean's denominator)."""
        _, samples = self.plan(step)
        return int(sum(int(self.packed.samples[s].assistant_mask[1:].sum()) for s in samples))

    def rows(self, step: int, dp_rank: int) -> list[list[tuple[tuple[int, ...], int]]]:
        """This rank's micro-batches, each a list of row keys ``(sample ids, length)`` for :class:`BalancedRows`;
        an empty micro-batch is one padding row."""
        step_plan, samples = self.plan(step)
        out = []
        for positions in step_plan.micro_batches[dp_rank]:
            ids = [samples[p] for p in positions]
            lengths = [len(self.packed.samples[s]) - 1 for s in ids]
            bins = pack_best_fit(lengths, self.seq_length) if self.packing else [[i] for i in range(len(ids))]
            rows = [tuple(ids[i] for i in b) for b in bins] or [()]
            longest = max((sum(len(self.packed.samples[s]) - 1 for s in r) for r in rows), default=0)
            length = trimmed_length(longest, self.seq_length, self.row_multiple)
            out.append([(r, length) for r in rows])
        return out

    def loader(self, first_step: int, dp_rank: int, num_workers: int) -> Iterator[dict]:
        """Micro-batches of this rank from step ``first_step`` on, decoded in ``num_workers`` processes."""

        def schedule() -> Iterator[list[tuple[tuple[int, ...], int]]]:
            step = first_step
            while True:
                yield from self.rows(step, dp_rank)
                step += 1

        return iter(vision_loader(BalancedRows(self.data), schedule(), num_workers=num_workers))

    def step_metrics(self, step: int) -> dict[str, float]:
        """Predicted max/mean rank cost before and after balancing, and the planning time."""
        step_plan, _ = self.plan(step)
        return {"balance_before": round(step_plan.before, 4), "balance_after": round(step_plan.after, 4),
                "balance_plan_ms": round(step_plan.seconds * 1e3, 3),
                "micro_batches": step_plan.num_micro_batches}


__all__ = ["BalancedRows", "BalancedVisionSamples", "encoder_tokens", "vision_cost_model"]
