"""loong-kernels' fused modules swapped into a transformers ``LlamaForCausalLM`` (``loong.llm.hf_fused``), on CPU.

The swapped model, run with the kernels' plain-PyTorch references (``backend="reference"``) or with the Triton
kernels under Triton's interpreter, gives the stock model's logits, loss and every gradient to fp32 tolerance, with
HF's parameter names, the same Parameter objects and the tied embedding kept.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from loong.core.errors import LoongError
from loong.llm.hf_fused import (
    FusedLlamaRMSNorm,
    FusedLMHead,
    FusedRoPELlamaAttention,
    FusedSwiGLUMLP,
    fuse_llama,
    fused_head,
    fused_lm_loss,
    resolve_hf_fused_kernels,
)
from loong.llm.models.fused import FusedKernels

VOCAB = 96


def _stock(tied: bool = True) -> LlamaForCausalLM:
    """A tiny LLaMA 3.2-like model: GQA, head_dim != hidden / heads, llama3 RoPE scaling, norms away from 1."""
    cfg = LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=64,
                      tie_word_embeddings=tied, attn_implementation="sdpa",
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                    "rope_theta": 500000.0})
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).train()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # a norm that is skipped or swapped for another shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
    return model


def _pair(backend: str, tied: bool = True) -> tuple[LlamaForCausalLM, LlamaForCausalLM, dict[str, int]]:
    stock = _stock(tied)
    fused = copy.deepcopy(stock)
    return stock, fused, fuse_llama(fused, FusedKernels.everything(backend))


def _batch(b: int = 2, s: int = 12, packed: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    batch = {"input_ids": torch.randint(0, VOCAB, (b, s), generator=g),
             "labels": torch.randint(0, VOCAB, (b, s), generator=g)}
    batch["labels"][0, :3] = -100  # ignored tokens (a prompt), as F.cross_entropy ignores them
    if packed:  # a second document from mid-row on: per-sample positions, HF's [b, s, d] tables, the kernel's [s, b, r]
        batch["position_ids"] = torch.arange(s).expand(b, s).clone()
        batch["position_ids"][1, s // 3:] -= s // 3
    return batch


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _compare(stock: LlamaForCausalLM, fused: LlamaForCausalLM, batch: dict[str, torch.Tensor], tol: float) -> None:
    labels = batch.pop("labels")
    with torch.no_grad():  # the fused head called plainly gives the logits
        assert _rel(fused(**batch).logits, stock(**batch).logits) <= tol
    loss = F.cross_entropy(stock(**batch).logits.float().flatten(0, 1), labels.flatten())
    loss.backward()
    fused_loss = fused_lm_loss(fused, labels, **batch)
    fused_loss.backward()
    assert fused_loss.shape == () and fused_loss.dtype == torch.float32
    assert _rel(fused_loss, loss) <= tol
    grads = {n: p.grad for n, p in fused.named_parameters()}
    assert grads.keys() == {n for n, _ in stock.named_parameters()}
    for name, p in stock.named_parameters():
        assert _rel(grads[name], p.grad) <= 10 * tol, name


@pytest.mark.parametrize("tied", [True, False])
def test_fused_llama_matches_stock_with_references(tied: bool) -> None:
    stock, fused, _ = _pair("reference", tied)
    _compare(stock, fused, _batch(), tol=1e-5)


def test_per_sample_positions_match_stock() -> None:
    stock, fused, _ = _pair("reference")
    _compare(stock, fused, _batch(packed=True), tol=1e-5)


def test_triton_kernels_under_interpreter_match_stock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real kernels (Triton's interpreter) in the swapped model: the same numbers."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    stock, fused, _ = _pair("triton")
    _compare(stock, fused, _batch(b=2, s=8, packed=True), tol=1e-5)


def test_modules_swapped_parameters_kept() -> None:
    stock, fused, counts = _pair("reference")
    before = {n: p for n, p in fused.named_parameters()}  # deepcopy's Parameters, before the swap is compared
    layer = fused.model.layers[0]
    assert counts == {"norm": 2 * 2 + 1, "swiglu": 2, "rope": 2, "cross_entropy": 1}
    assert isinstance(layer.input_layernorm, FusedLlamaRMSNorm)
    assert isinstance(layer.post_attention_layernorm, FusedLlamaRMSNorm)
    assert isinstance(fused.model.norm, FusedLlamaRMSNorm)
    assert isinstance(layer.mlp, FusedSwiGLUMLP) and isinstance(layer.self_attn, FusedRoPELlamaAttention)
    assert isinstance(fused.lm_head, FusedLMHead) and fused_head(fused) is fused.lm_head
    assert fused.lm_head.weight is fused.model.embed_tokens.weight  # still tied
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in stock.named_parameters()]
    assert fused.state_dict().keys() == stock.state_dict().keys()
    for name, t in stock.state_dict().items():
        assert torch.equal(fused.state_dict()[name], t), name
    assert all(p is before[n] for n, p in fused.named_parameters())
    assert not any(p.is_meta for p in fused.parameters())
    again = fuse_llama(fused, FusedKernels.everything("reference"))  # nothing left to swap
    assert again == dict.fromkeys(counts, 0)


def test_plan_picks_what_is_swapped() -> None:
    model = _stock()
    counts = fuse_llama(model, FusedKernels(norm=True, backend="reference"))
    assert counts == {"norm": 5, "swiglu": 0, "rope": 0, "cross_entropy": 0}
    assert type(model.lm_head) is torch.nn.Linear and fused_head(model) is None
    with pytest.raises(LoongError, match="not a FusedLMHead"):
        fused_lm_loss(model, torch.zeros(1, 4, dtype=torch.long), input_ids=torch.zeros(1, 4, dtype=torch.long))


def test_resolve_hf_fused_kernels() -> None:
    assert resolve_hf_fused_kernels("off", {"triton"}) == FusedKernels()
    assert resolve_hf_fused_kernels("auto", {"sdpa"}) == FusedKernels()  # CPU: HF's modules
    assert resolve_hf_fused_kernels("auto", {"triton", "sdpa"}) == FusedKernels.everything("auto")
    assert resolve_hf_fused_kernels("on", {"triton", "transformer_engine"}) == FusedKernels.everything("triton")
    with pytest.raises(LoongError, match="does not report the 'triton' capability.*reports: sdpa"):
        resolve_hf_fused_kernels("on", {"sdpa"})
    with pytest.raises(LoongError, match="must be one of"):
        resolve_hf_fused_kernels("yes", {"triton"})
