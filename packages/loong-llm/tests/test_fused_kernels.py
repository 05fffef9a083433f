"""The fused-kernel wiring of the dense models (``model.fused_kernels``), on CPU.

The fused modules run here with the references (``backend="reference"``) or the Triton kernels under
Triton's interpreter, and must give the unfused model's logits, per-token losses and gradients to fp32
tolerance, with the same state-dict keys. The GPU twin of these checks is in ``test_gpu.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from loong.core.accelerators import select_accelerator
from loong.core.config.schema import ParallelConfig
from loong.core.engines.megatron.layout import world
from loong.core.engines.megatron.state import gather_full_state, load_full_state
from loong.core.errors import LoongError
from loong.llm.models.build import build_gpt_model, transformer_config
from loong.llm.models.config import DenseModelConfig, RopeScaling
from loong.llm.models.fused import FusedKernels, FusedRMSNorm, FusedSwiGLU, resolve_fused_kernels

# Qwen3-like: QK-norm, tied embeddings, llama3 rope scaling, head_dim != hidden / heads
QWEN3ISH = DenseModelConfig(family="qwen3", num_layers=2, hidden_size=48, ffn_hidden_size=80, num_attention_heads=4,
                            num_query_groups=2, head_dim=16, vocab_size=300, qk_norm=True, tie_word_embeddings=True,
                            rope_theta=500000.0, rope_scaling=RopeScaling(original_max_position_embeddings=16))


@pytest.fixture(scope="module")
def cpu():
    """A world of one on the CPU accelerator, for the whole module."""
    acc = select_accelerator("cpu")
    with world(acc) as layout:
        yield acc, layout


def _build(cpu, cfg: DenseModelConfig, fused: FusedKernels | None) -> torch.nn.Module:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    acc, layout = cpu
    model_parallel_cuda_manual_seed(0)
    tc = transformer_config(cfg, ParallelConfig(), torch.float32, {"use_cpu_initialization": True})
    return build_gpt_model(cfg, tc, acc.capabilities(), True, True, layout.pg_collection, fused_kernels=fused)


def _pair(cpu, cfg: DenseModelConfig, backend: str, hf: Path | None = None):
    """(unfused, fused) models with the same weights (from ``hf`` when given, else random norms too)."""
    plain, fused = _build(cpu, cfg, None), _build(cpu, cfg, FusedKernels.everything(backend))
    if hf is not None:
        from loong.llm.hf import load_hf_into

        load_hf_into([plain], hf, cfg)
    state = gather_full_state([plain])
    g = torch.Generator().manual_seed(5)
    for k, t in state.items():  # norms away from 1, so a norm that is skipped or swapped shows
        if "norm" in k:
            t.copy_(1.0 + 0.3 * torch.randn(t.shape, generator=g))
    load_full_state([plain], state)
    load_full_state([fused], state)
    return plain, fused


def _batch(vocab: int, b: int = 2, s: int = 24, packed: bool = False):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (b, s), generator=g)
    labels = torch.randint(0, vocab, (b, s), generator=g)
    pos = torch.arange(s).expand(b, -1).clone()
    if packed:  # a second document starting mid-row: positions restart (per-sample RoPE tables)
        pos[1, s // 3:] -= s // 3
    mask = (torch.rand(b, s, generator=g) < 0.7).float()  # SFT-like loss mask (prompt tokens off)
    return tokens, pos, labels, mask


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def _compare(plain, fused, vocab: int, packed: bool, tol: float) -> None:
    tokens, pos, labels, mask = _batch(vocab, packed=packed)
    with torch.no_grad():
        assert _rel(fused(tokens, pos, None), plain(tokens, pos, None)) <= tol  # logits (no labels)
    for weights in (torch.ones_like(mask) / mask.numel(), mask):  # pretraining's mean; SFT's masked sum
        outs = []
        for model in (plain, fused):
            model.zero_grad(set_to_none=True)
            losses = model(tokens, pos, None, labels=labels)
            (losses.float() * weights).sum().backward()
            outs.append((losses.detach(), {n: p.grad for n, p in model.named_parameters()}))
        (lp, gp), (lf, gf) = outs
        assert lf.shape == lp.shape == labels.shape and lf.dtype == torch.float32
        assert _rel(lf, lp) <= tol
        assert gf.keys() == gp.keys()
        for name in gp:
            assert _rel(gf[name], gp[name]) <= 10 * tol, name


def test_fused_llama_from_hf_matches_unfused(cpu, tiny_llama_hf: Path) -> None:
    from loong.llm.hf import model_config_from_hf

    cfg = model_config_from_hf(tiny_llama_hf)
    plain, fused = _pair(cpu, cfg, "reference", tiny_llama_hf)
    _compare(plain, fused, cfg.vocab_size, packed=False, tol=1e-5)


def test_fused_qk_norm_tied_packed_matches_unfused(cpu) -> None:
    plain, fused = _pair(cpu, QWEN3ISH, "reference")
    _compare(plain, fused, QWEN3ISH.vocab_size, packed=True, tol=1e-5)


def test_triton_kernels_under_interpreter_match_unfused(cpu, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real kernels (Triton's interpreter), wired into the model: the same numbers."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    plain, fused = _pair(cpu, QWEN3ISH, "triton")
    _compare(plain, fused, QWEN3ISH.vocab_size, packed=True, tol=1e-5)


def test_modules_are_swapped_and_keys_unchanged(cpu) -> None:
    plain, fused = _pair(cpu, QWEN3ISH, "reference")
    layer = fused.decoder.layers[0]
    assert isinstance(layer.input_layernorm, FusedRMSNorm) and isinstance(layer.pre_mlp_layernorm, FusedRMSNorm)
    assert isinstance(layer.self_attention.q_layernorm, FusedRMSNorm)
    assert isinstance(fused.decoder.final_layernorm, FusedRMSNorm)
    assert isinstance(layer.mlp.activation_func, FusedSwiGLU)
    assert type(layer.self_attention).__name__ == "FusedRoPESelfAttention"
    assert not isinstance(plain.decoder.final_layernorm, FusedRMSNorm)
    assert plain.state_dict().keys() == fused.state_dict().keys()
    assert plain.sharded_state_dict().keys() == fused.sharded_state_dict().keys()  # checkpoints, HF mapping


def test_resolve_fused_kernels() -> None:
    tc = transformer_config(QWEN3ISH, ParallelConfig(), torch.float32)
    tc_tp2 = transformer_config(QWEN3ISH, ParallelConfig(tp=2), torch.float32)
    assert resolve_fused_kernels("off", {"triton", "sdpa"}, tc) == FusedKernels()
    assert resolve_fused_kernels("auto", {"sdpa"}, tc) == FusedKernels()  # CPU: megatron's modules
    assert resolve_fused_kernels("auto", {"triton", "sdpa"}, tc) == FusedKernels.everything("auto")
    assert resolve_fused_kernels("on", {"triton"}, tc) == FusedKernels.everything("triton")
    tp2 = resolve_fused_kernels("auto", {"triton"}, tc_tp2)  # vocabulary-parallel logits: megatron's loss
    assert tp2.norm and tp2.swiglu and tp2.rope and not tp2.cross_entropy
    te = resolve_fused_kernels("auto", {"triton", "transformer_engine"}, tc)  # TE's spec fuses the layers
    assert te == FusedKernels(cross_entropy=True, backend="auto")
    with pytest.raises(LoongError, match="fused_kernels=on needs the Triton kernels.*reports: sdpa"):
        resolve_fused_kernels("on", {"sdpa"}, tc)
    with pytest.raises(LoongError, match="must be one of"):
        resolve_fused_kernels("yes", {"triton"}, tc)


def test_on_without_triton_fails_cleanly(cpu) -> None:
    cfg = DenseModelConfig(fused_kernels="on")
    with pytest.raises(LoongError, match="does not report the 'triton' capability"):
        _build(cpu, cfg, None)  # the CPU accelerator reports no Triton


def test_lora_output_layer_takes_megatron_loss(cpu) -> None:
    """A subclassed output layer (e.g. LoRA) is not bypassed by the fused loss."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    plain, fused = _pair(cpu, QWEN3ISH, "reference")
    tokens, pos, labels, _ = _batch(QWEN3ISH.vocab_size)
    called = []

    class Wrapped(ColumnParallelLinear):
        def forward(self, *a, **k):
            called.append(1)
            return super().forward(*a, **k)

    fused.output_layer.__class__ = Wrapped
    with torch.no_grad():
        assert _rel(fused(tokens, pos, None, labels=labels), plain(tokens, pos, None, labels=labels)) <= 1e-5
    assert called


def test_fp8_output_layer_runs_the_fused_loss_in_fp8(cpu, monkeypatch: pytest.MonkeyPatch) -> None:
    """``precision.fp8_output_layer``: the model's fused loss takes the kernels' FP8 path (Triton's interpreter,
    ``torch._scaled_mm`` on the CPU): losses and gradients move by FP8's rounding, not more, and only the output
    layer's computation changes (the logits without labels stay the bf16 path's)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = dataclasses.replace(QWEN3ISH, vocab_size=320)  # tied embeddings: the output weight is the embedding's
    (_, plain), (_, fp8) = _pair(cpu, cfg, "triton"), _pair(cpu, cfg, "triton")  # the same weights, fused twice
    assert fp8.enable_fp8_output_layer() and fp8.fp8_output_layer and not plain.fp8_output_layer
    tokens, pos, labels, mask = _batch(cfg.vocab_size)
    with torch.no_grad():
        assert torch.equal(fp8(tokens, pos, None), plain(tokens, pos, None))
    outs = []
    for model in (plain, fp8):
        model.zero_grad(set_to_none=True)
        losses = model(tokens, pos, None, labels=labels)
        (losses * mask).sum().backward()
        outs.append((losses.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (lp, gp), (lf, gf) = outs
    # measured 0.08% (losses) and 1.8-3.3% (gradients) apart; a model that ignored the flag would be 0 apart
    assert 1e-4 < _rel_norm(lf, lp) < 0.01
    for name in gp:
        assert 1e-4 < _rel_norm(gf[name], gp[name]) < 0.08, name


def test_fp8_output_layer_refusals(cpu) -> None:
    plain, fused = _pair(cpu, dataclasses.replace(QWEN3ISH, vocab_size=320), "reference")
    with pytest.raises(LoongError, match="it needs the fused linear . cross-entropy"):
        plain.enable_fp8_output_layer()
    with pytest.raises(LoongError, match="runs its plain-PyTorch reference here, which has no FP8 path"):
        fused.enable_fp8_output_layer()
    assert not plain.fp8_output_layer and not fused.fp8_output_layer


def _rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())
