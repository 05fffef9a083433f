"""``model.moe_grouped_mm``: a rank's experts as two grouped matrix products instead of a loop of small ones.

megatron-core's ``SequentialMLP`` runs one ``MLP`` per local expert, one after the other: with 128 small experts
(Qwen3-30B-A3B: ``moe_ffn_hidden_size`` 768) that is 256 small GEMMs and their launches per layer and pass. Its
grouped alternatives need Transformer Engine (``TEGroupedMLP``) or the ``grouped_gemm`` package. torch has its own
grouped GEMM, ``torch._grouped_mm`` (the one torchtitan's MoE uses): one call multiplies each expert's contiguous
block of tokens by that expert's weight.

:class:`GroupedMMExperts` is ``SequentialMLP`` with the same parameters (``local_experts.<i>.linear_fc1/fc2``), so
checkpoints, the HF mapping and expert-parallel sharding are unchanged; only the forward differs: the experts'
weights are stacked (a copy of the rank's expert weights per pass; their gradients flow back through the stack) and
``fc1 -> activation × router probability -> fc2`` runs as two grouped products with the same activation code as
megatron's ``MLP``. Where the grouped path does not apply (one local expert, biases, FP8/FP4 padding) the loop runs.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import torch
from megatron.core.transformer.moe.experts import SequentialMLP


class GroupedMMExperts(SequentialMLP):
    """``SequentialMLP`` whose forward is two ``torch._grouped_mm`` calls (see the module docstring)."""

    def _grouped_applies(self) -> bool:
        cfg, first = self.config, self.local_experts[0]
        return (self.num_local_experts > 1 and not (cfg.fp8 or cfg.fp4)
                and first.linear_fc1.bias is None and first.linear_fc2.bias is None)

    def _activation(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """megatron ``MLP``'s activation and router-probability scaling (its unfused branch, or the spec's
        activation module under ``use_te_activation_func``) on the fc1 output of every expert at once."""
        cfg, dtype = self.config, h.dtype
        if cfg.use_te_activation_func:
            h = self.local_experts[0].activation_func(h)
        elif cfg.gated_linear_unit:
            x_glu, x_linear = torch.chunk(h, 2, dim=-1)
            if (val := cfg.activation_func_clamp_value) is not None:
                x_glu, x_linear = x_glu.clamp(min=None, max=val), x_linear.clamp(min=-val, max=val)
            h = cfg.activation_func(x_glu) * (x_linear + cfg.glu_linear_offset)
        else:
            h = cfg.activation_func(h)
        return (h * probs.unsqueeze(-1)).to(dtype)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``[T, h]`` tokens sorted by local expert, ``tokens_per_expert [E]`` and their router probabilities ``[T]``
        -> ``([T, h], None)``, as ``SequentialMLP.forward``."""
        if not self._grouped_applies():
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # as SequentialMLP: scale the input, then probabilities of 1
            x, probs = (probs.unsqueeze(-1) * x).to(x.dtype), torch.ones_like(probs)
        ends = torch.cumsum(torch.as_tensor(tokens_per_expert, device=x.device), 0).to(torch.int32)
        w1 = torch.stack([e.linear_fc1.weight for e in self.local_experts])  # [E, fc1_out, h]
        w2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])  # [E, h, ffn]
        hidden = self._activation(torch._grouped_mm(x, w1.transpose(1, 2), offs=ends), probs)
        return torch._grouped_mm(hidden, w2.transpose(1, 2), offs=ends), None


def uses_grouped_mm(model: Any, capabilities: set[str]) -> bool:
    """Whether ``model.moe_grouped_mm`` (``auto`` | true | false) puts :class:`GroupedMMExperts` in an MoE model on
    an accelerator with ``capabilities``: ``auto`` where it reports ``grouped_mm``. The training task turns ``auto``
    into false under FP8 (whose recipes reach the experts only through their linear layers)."""
    if not model.is_moe:
        return False
    return model.moe_grouped_mm is True or (model.moe_grouped_mm == "auto" and "grouped_mm" in capabilities)


def with_grouped_mm_experts(moe_layer: partial) -> partial:
    """A layer spec's ``MoELayer`` builder with :class:`GroupedMMExperts` in place of its ``SequentialMLP`` experts
    (their submodules, e.g. a fused activation, kept)."""
    subs = moe_layer.keywords["submodules"]
    experts = partial(GroupedMMExperts, *subs.experts.args, **subs.experts.keywords)
    return partial(moe_layer.func, *moe_layer.args,
                   **{**moe_layer.keywords, "submodules": dataclasses.replace(subs, experts=experts)})
