"""FP8 on the MoE and MLA families (``precision.fp8``), with emulated GEMMs on CPU.

The FP8 conversion swaps megatron-core's Column/RowParallelLinear classes in place, so it must reach the
experts (``SequentialMLP``'s local experts and the shared experts) and MLA's projections as well as a dense
model's four linears; keys stay the same; the router, norms, embeddings and the output layer stay high
precision; the converted model stays close to the fp32 one and trains (finite gradients everywhere).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from loong.core.config.schema import PrecisionConfig
from loong.core.engines.megatron.fp8 import convert_linears, plan_fp8
from loong.llm.models.config import DenseModelConfig

MOE = DenseModelConfig(family="qwen3_moe", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                       num_query_groups=2, head_dim=16, vocab_size=256, qk_norm=True, num_experts=4,
                       moe_ffn_hidden_size=32, moe_router_topk=2, fused_kernels="off")
MLA = dataclasses.replace(MOE, family="deepseek_v3", qk_norm=False, q_lora_rank=32, kv_lora_rank=32,
                          qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, moe_shared_experts=1,
                          first_k_dense_replace=1, moe_router_score_function="sigmoid",
                          moe_router_enable_expert_bias=True, moe_aux_loss_coeff=0.0)


def _batch(vocab: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (2, 32), generator=g)
    return tokens, torch.arange(32).expand(2, -1), torch.randint(0, vocab, (2, 32), generator=g)


def _names(plans, converted: bool) -> set[str]:
    """Layer names with the layer index and expert number replaced by ``*``."""
    return {re.sub(r"\.\d+\.", ".*.", p.name) for p in plans if (p.recipe is not None) == converted}


@pytest.mark.parametrize("cfg", [MOE, MLA], ids=["qwen3_moe", "deepseek_v3"])
def test_fp8_reaches_experts_and_mla_and_trains(build_gpt, cfg) -> None:  # noqa: ANN001
    model = build_gpt(cfg).train()
    keys = sorted(model.state_dict())
    tokens, pos, labels = _batch(cfg.vocab_size)
    with torch.no_grad():
        ref = model(tokens, pos, None)
    plans = plan_fp8([model], PrecisionConfig(fp8="tensorwise"), tokens.numel(), native=False)
    fp8 = _names(plans, True)
    experts = {"decoder.layers.*.mlp.experts.local_experts.*.linear_fc1",
               "decoder.layers.*.mlp.experts.local_experts.*.linear_fc2"}
    assert experts <= fp8, sorted(fp8)
    if cfg is MLA:
        assert {"decoder.layers.*.mlp.shared_experts.linear_fc1", "decoder.layers.*.mlp.shared_experts.linear_fc2",
                "decoder.layers.*.self_attention.linear_q_down_proj", "decoder.layers.*.self_attention.linear_q_up_proj",
                "decoder.layers.*.self_attention.linear_kv_up_proj", "decoder.layers.*.self_attention.linear_proj",
                "decoder.layers.*.mlp.linear_fc1"} <= fp8, sorted(fp8)  # layer 0 is dense
    else:
        assert {"decoder.layers.*.self_attention.linear_qkv", "decoder.layers.*.self_attention.linear_proj"} <= fp8
    assert not any("router" in n for n in fp8) and "output_layer" in _names(plans, False)
    assert convert_linears([model], plans, native=False) == sum(p.recipe is not None for p in plans)
    assert sorted(model.state_dict()) == keys
    with torch.no_grad():
        out = model(tokens, pos, None)
    rel = float((out - ref).norm() / ref.norm())
    assert 1e-4 < rel < 0.08, rel  # fp8 rounding shows, and stays small
    model(tokens, pos, None, labels=labels).mean().backward()
    expert_w = model.decoder.layers[-1].mlp.experts.local_experts[0].linear_fc1.weight
    assert expert_w.grad is not None and expert_w.grad.abs().sum() > 0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
