"""Data-parallel balancing of SFT conversations (``data.balance.enabled=true``).

The global batch of a step is what it is without balancing: the ``global_batch_size`` sequences the
sampler picks. Balancing redistributes the *conversations* inside them: the core planner gives
each data-parallel rank a set of conversations of about equal cost (``a*len**2 + b*len + c``,
attention being quadratic) and splits them into micro-batches holding at most
``micro_batch_size * seq_length`` real tokens. Each micro-batch is then laid out as rows
(best-fit packed with ``data.packing``, else one conversation per row) trimmed to its longest row,
so short conversations no longer pay for padding to ``seq_length``; the length is rounded up to
:func:`row_multiple` (8, and what sequence / context parallelism split every row into). The loss is the per-token mean
of the same conversations, so only summation order changes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from loong.core.balance import CostModel, DataBalancer, StepPlan
from loong.core.config.schema import ParallelConfig
from loong.core.engines.megatron.layout import sequence_multiple
from loong.llm.data.text import GlobalBatchSampler
from loong.llm.models.config import DenseModelConfig, runs_sequence_parallel
from loong.llm.sft.packing import PackedSequences, pack_best_fit, pack_row

ROW_MULTIPLE = 8  # trimmed rows are rounded up to a multiple of this many slots (friendly GEMM shapes)


def row_multiple(model: DenseModelConfig, parallel: ParallelConfig) -> int:
    """What a trimmed row's length must divide by: :data:`ROW_MULTIPLE` and the layout's sequence split (``tp``
    under sequence parallelism, asked for or implied by a MoE / MLA model; ``2 * cp`` / ``cp * tp`` under context
    parallelism: :func:`~loong.core.engines.megatron.layout.sequence_multiple`), e.g. 24 at ``tp=3`` with SP."""
    sp = runs_sequence_parallel(model, parallel.tp, parallel.sequence_parallel)
    return math.lcm(ROW_MULTIPLE, sequence_multiple(parallel.tp, parallel.cp, sp))


def trimmed_length(longest: int, seq_length: int, multiple: int) -> int:
    """The length of a balanced micro-batch's rows: its ``longest`` row rounded up to ``multiple`` (at least one
    multiple: an empty micro-batch is one padding row), at most ``seq_length`` (which the layout check makes a
    multiple of the sequence split, so a capped row splits too)."""
    return min(seq_length, max(multiple, -(-longest // multiple) * multiple))


def conversation_cost_model(model: DenseModelConfig) -> CostModel:
    """Training FLOPs of one sequence of ``n`` tokens: ``6·N·n`` (weights) + ``12·L·H·d·n²``
    (attention scores, counted as :func:`training_flops_per_token` does)."""
    n_params = model.num_parameters() - (0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size)
    attention = 12.0 * model.num_layers * model.num_attention_heads * model.kv_channels
    return CostModel(a=attention, b=6.0 * n_params, c=0.0)


class BalancedConversations:
    """Each step's plan (the same on every rank) and this rank's micro-batches of rows."""

    def __init__(self, cfg: Any, data: PackedSequences, sampler: GlobalBatchSampler, dp_size: int,
                 dp_group: Any) -> None:
        t, b = cfg.train, cfg.data.balance
        self.data, self.sampler = data, sampler
        self.gbs, self.mbs, self.seq_length = t.global_batch_size, t.micro_batch_size, t.seq_length
        self.packing = cfg.data.packing
        self.row_multiple = row_multiple(cfg.model, cfg.parallel)
        self.default_micro_batches = t.global_batch_size // (t.micro_batch_size * dp_size)
        self.balancer = DataBalancer(b.cost, conversation_cost_model(cfg.model), dp_size, t.seed,
                                     fit_steps=b.fit_steps, dp_group=dp_group)
        self._cached: tuple[int, StepPlan, list[int]] | None = None

    def plan(self, step: int) -> tuple[StepPlan, list[int]]:
        """The step's plan and its conversations (document ids, by plan position)."""
        if self._cached is not None and self._cached[0] == step:
            return self._cached[1], self._cached[2]
        rows = [self.sampler.index(g) for g in range(step * self.gbs, (step + 1) * self.gbs)]
        docs: list[int] = []
        default_ranks: list[int] = []
        rows_per_rank = self.default_micro_batches * self.mbs
        for k, row in enumerate(rows):
            docs.extend(self.data.bins[row])
            default_ranks.extend([k // rows_per_rank] * len(self.data.bins[row]))
        lengths = [len(self.data.docs[d]) for d in docs]
        step_plan = self.balancer.plan_step(step, lengths, default_ranks, self.default_micro_batches,
                                            capacity=self.mbs * self.seq_length)
        self._cached = (step, step_plan, docs)
        return step_plan, docs

    def loss_tokens(self, step: int) -> int:
        """Assistant tokens of the whole global batch (the per-token mean's denominator)."""
        _, docs = self.plan(step)
        return int(sum(int(self.data.docs[d].loss.sum()) for d in docs))

    def rows(self, step: int, dp_rank: int) -> list[list[list[int]]]:
        """This rank's micro-batches, each a list of rows, each a list of document ids."""
        step_plan, docs = self.plan(step)
        out = []
        for positions in step_plan.micro_batches[dp_rank]:
            ids = [docs[p] for p in positions]
            if self.packing:
                bins = pack_best_fit([len(self.data.docs[d]) for d in ids], self.seq_length)
                out.append([[ids[i] for i in b] for b in bins])
            else:
                out.append([[d] for d in ids])
        return out

    def row_arrays(self, rows: list[list[int]]) -> list[dict[str, np.ndarray]]:
        """Row arrays trimmed to the longest row, rounded up to :attr:`row_multiple` (an empty micro-batch is one
        padding row)."""
        longest = max((sum(len(self.data.docs[d]) for d in row) for row in rows), default=0)
        length = trimmed_length(longest, self.seq_length, self.row_multiple)
        return [pack_row(self.data.docs, row, length, self.data.pad_id) for row in rows or [[]]]

    def step_metrics(self, step: int) -> dict[str, float]:
        """Predicted max/mean rank cost before and after balancing, and the planning time."""
        step_plan, _ = self.plan(step)
        return {"balance_before": round(step_plan.before, 4), "balance_after": round(step_plan.after, 4),
                "balance_plan_ms": round(step_plan.seconds * 1e3, 3),
                "micro_batches": step_plan.num_micro_batches}
