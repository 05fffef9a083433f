"""Activation recomputation (``model.recompute``): the same loss and gradients as without, less kept memory.

megatron-core recomputes in backward what ``selective`` (the core attention) or ``full`` (whole layers, in
chunks of ``recompute_num_layers``) did not keep. On CPU in fp32 the recomputed forward is the same
arithmetic, so the training step must match the plain one to rounding — for a dense model, for
Qwen3-MoE (the router's aux loss goes through megatron's autoscaler in the recomputed forward), for
DeepSeek-V3 (MLA, shared experts, expert bias) and for DeepSeek-V3.2 (sparse attention with the indexer's
loss, which joins the gradient in the recomputed forward).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loong.core.config.schema import ParallelConfig
from loong.core.engines.megatron.state import gather_full_state, load_full_state
from loong.core.errors import LoongError
from loong.llm.models.build import transformer_config
from loong.llm.models.config import DenseModelConfig

DENSE = DenseModelConfig(family="qwen3", num_layers=3, hidden_size=48, ffn_hidden_size=80, num_attention_heads=4,
                         num_query_groups=2, head_dim=16, vocab_size=300, qk_norm=True, fused_kernels="off")
MOE = dataclasses.replace(DENSE, family="qwen3_moe", num_experts=4, moe_ffn_hidden_size=24, moe_router_topk=2,
                          moe_aux_loss_coeff=0.01)
MLA = dataclasses.replace(DENSE, family="deepseek_v3", num_experts=4, moe_ffn_hidden_size=24, moe_router_topk=2,
                          qk_norm=False, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                          v_head_dim=8, moe_shared_experts=1, first_k_dense_replace=1,
                          moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                          moe_aux_loss_coeff=0.0)
DSA = dataclasses.replace(MLA, family="deepseek_v32", index_n_heads=2, index_head_dim=16, index_topk=8)


def _step(model: torch.nn.Module, vocab: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and every parameter's gradient of one training forward/backward."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (2, 20), generator=g)
    labels = torch.randint(0, vocab, (2, 20), generator=g)
    pos = torch.arange(20).expand(2, -1)
    model.zero_grad(set_to_none=True)
    loss = model(tokens, pos, None, labels=labels).mean()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _count_calls(module: torch.nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _plain_vs(build_gpt, cfg: DenseModelConfig, **recompute) -> None:  # noqa: ANN001
    plain = build_gpt(cfg).train()
    other = build_gpt(dataclasses.replace(cfg, **recompute)).train()
    load_full_state([other], gather_full_state([plain]))
    # recomputation really happens: the recomputed module runs a second time, in backward
    layer = other.decoder.layers[0]
    watched = layer if recompute["recompute"] == "full" else layer.self_attention.core_attention
    calls = _count_calls(watched)
    loss_a, grads_a = _step(plain, cfg.vocab_size)
    loss_b, grads_b = _step(other, cfg.vocab_size)
    assert calls[0] == 2, calls
    assert abs(loss_a - loss_b) <= 1e-6 * abs(loss_a)
    assert sorted(grads_a) == sorted(grads_b) and grads_a
    for name, ga in grads_a.items():
        torch.testing.assert_close(grads_b[name], ga, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("cfg", [DENSE, MOE, MLA, DSA], ids=["dense", "qwen3_moe", "deepseek_v3", "deepseek_v32"])
@pytest.mark.parametrize("recompute", [dict(recompute="full", recompute_num_layers=1),
                                       dict(recompute="full", recompute_num_layers=2),
                                       dict(recompute="selective")], ids=["full1", "full2", "selective"])
def test_recompute_gives_the_same_step(build_gpt, cfg, recompute) -> None:
    if cfg is DSA and recompute["recompute"] == "selective":
        with pytest.raises(LoongError, match="use model.recompute=full"):
            transformer_config(dataclasses.replace(cfg, **recompute), ParallelConfig(), torch.float32)
        return
    _plain_vs(build_gpt, cfg, **recompute)


def test_recompute_num_layers_must_be_positive() -> None:
    with pytest.raises(LoongError, match="recompute_num_layers=0"):
        transformer_config(dataclasses.replace(DENSE, recompute="full", recompute_num_layers=0), ParallelConfig(),
                           torch.float32)
