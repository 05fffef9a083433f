"""GPU checks (run on an accelerator machine: ``pytest -m gpu``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda_layout():
    """A world of one on the GPU, per test (a training run in between tears process groups down)."""
    from loong.core.accelerators import select_accelerator
    from loong.core.config.schema import ParallelConfig
    from loong.core.engines.megatron.layout import init_distributed, shutdown_distributed

    if not torch.cuda.is_available():
        pytest.fail("gpu tests need CUDA")
    acc = select_accelerator()
    with acc.activate():
        layout = init_distributed(acc, ParallelConfig())
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
        yield acc, layout
        shutdown_distributed()


def _model(acc, layout, cfg, dtype, sdpa: bool):  # noqa: ANN001, ANN202
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from loong.core.config.schema import ParallelConfig
    from loong.llm.models import build

    tc = build.transformer_config(cfg, ParallelConfig(), dtype, acc.megatron_config_overrides())
    if sdpa:
        return build.build_gpt_model(cfg, tc, acc.capabilities(), True, True, layout.pg_collection).cuda()
    from megatron.core.models.gpt import GPTModel

    spec = get_gpt_layer_local_spec(qk_layernorm=cfg.qk_norm, normalization="RMSNorm")
    return GPTModel(config=tc, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                    max_sequence_length=cfg.max_position_embeddings, position_embedding_type="rope",
                    rotary_base=int(cfg.rope_theta), pg_collection=layout.pg_collection).cuda()


def test_cuda_accelerator_is_chosen_with_bf16(cuda_layout) -> None:  # noqa: ANN001
    acc, _ = cuda_layout
    assert acc.name == "cuda" and acc.backend == "nccl"
    assert acc.default_dtype() == torch.bfloat16
    assert acc.peak_flops(torch.bfloat16) is not None


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_sdpa_attention_matches_megatron_local_attention(cuda_layout, dtype, tol) -> None:  # noqa: ANN001
    from loong.core.engines.megatron.state import gather_full_state, load_full_state
    from loong.llm.models.config import DenseModelConfig

    acc, layout = cuda_layout
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = DenseModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=8,
                           num_query_groups=2, vocab_size=512, max_position_embeddings=512)
    ours, ref = _model(acc, layout, cfg, dtype, True), _model(acc, layout, cfg, dtype, False)
    load_full_state([ref], gather_full_state([ours]))
    tokens = torch.randint(0, 512, (2, 256), device="cuda")
    pos = torch.arange(256, device="cuda").expand(2, -1)
    mask = torch.triu(torch.ones(256, 256, dtype=torch.bool, device="cuda"), 1)[None, None]
    with torch.no_grad():
        a = ours(tokens, pos, None).float()
        b = ref(tokens, pos, mask).float()
    assert ((a - b).abs().max() / b.abs().max()).item() <= tol


def test_train_tiny_model_in_bf16_on_gpu(tmp_path: Path) -> None:
    from loong.llm.cli import main

    code = main(["train", "train.steps=40", "train.progress=false", f"output_dir={tmp_path}", "run_name=g",
                 "train.eval_interval=0", "train.eval_iters=1"])
    assert code == 0
    records = [json.loads(line) for line in (tmp_path / "g" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train_loss" in r]
    assert train[-1]["train_loss"] < 0.9 * train[0]["train_loss"]
    assert "mfu" in train[-1] and train[-1]["peak_memory_gib"] > 0
    assert (tmp_path / "g" / "checkpoints" / "latest").is_file()


def test_hf_llama_logits_match_on_gpu_in_bf16(cuda_layout, tiny_llama_hf: Path) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    from loong.core.config.schema import ParallelConfig
    from loong.llm.hf import load_hf_into, model_config_from_hf
    from loong.llm.models import build

    acc, layout = cuda_layout
    cfg = model_config_from_hf(tiny_llama_hf)
    tc = build.transformer_config(cfg, ParallelConfig(), torch.bfloat16, acc.megatron_config_overrides())
    ours = build.build_gpt_model(cfg, tc, acc.capabilities(), True, True, layout.pg_collection).cuda()
    load_hf_into([ours], tiny_llama_hf, cfg)
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_hf, dtype=torch.bfloat16).cuda().eval()
    tokens = torch.randint(0, 512, (2, 128), device="cuda")
    pos = torch.arange(128, device="cuda").expand(2, -1)
    with torch.no_grad():
        a = ours(tokens, pos, None).float()
        b = ref(tokens).logits.float()
    assert ((a - b).abs().max() / b.abs().max()).item() <= 3e-2
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.95


def _train_losses(run: Path) -> list[float]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["train_loss"] for r in recs if "train_loss" in r]


def test_sft_with_packing_trains_in_bf16_on_gpu(tmp_path: Path) -> None:
    from loong.llm.cli import main

    code = main(["train", "task=sft", "train.seq_length=256", "train.steps=30", "train.global_batch_size=8",
                 "train.micro_batch_size=4", "train.progress=false", "train.eval_iters=0",
                 f"output_dir={tmp_path}", "run_name=sft"])
    assert code == 0
    losses = _train_losses(tmp_path / "sft")
    assert losses[-1] < 0.8 * losses[0]


def test_lora_trains_in_bf16_on_gpu_and_exports_merged(tiny_llama_hf: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from loong.llm.cli import main

    code = main(["train", f"model.init_from_hf={tiny_llama_hf}", "model.lora.rank=8", "train.steps=20",
                 "train.seq_length=64", "train.global_batch_size=8", "train.micro_batch_size=4",
                 "train.lr=1e-2", "train.progress=false", "train.eval_iters=0", "train.save_hf=true",
                 f"output_dir={tmp_path}", "run_name=lora"])
    assert code == 0
    losses = _train_losses(tmp_path / "lora")
    assert losses[-1] < losses[0]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "lora" / "hf")
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_hf)
    w = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[w].float(), base.state_dict()[w].float())  # adapters merged


def _fused_trio(acc, layout, cfg):  # noqa: ANN001, ANN202
    """(unfused bf16, fused bf16, unfused fp32 oracle) with the same (bf16-representable) weights."""
    from loong.core.config.schema import ParallelConfig
    from loong.core.engines.megatron.state import gather_full_state, load_full_state
    from loong.llm.models import build
    from loong.llm.models.fused import FusedKernels

    def make(dtype, fused):  # noqa: ANN001, ANN202
        tc = build.transformer_config(cfg, ParallelConfig(), dtype, acc.megatron_config_overrides())
        model = build.build_gpt_model(cfg, tc, acc.capabilities(), True, True, layout.pg_collection,
                                      fused_kernels=fused).cuda()
        return model.bfloat16() if dtype == torch.bfloat16 else model  # as megatron's Float16Module casts

    plain, fused, oracle = (make(torch.bfloat16, FusedKernels()), make(torch.bfloat16, FusedKernels.everything("triton")),
                            make(torch.float32, FusedKernels()))
    state = gather_full_state([plain])
    g = torch.Generator().manual_seed(3)
    for k, t in state.items():
        if "norm" in k:  # norms away from 1, so every norm matters
            t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
    for m in (plain, fused, oracle):
        load_full_state([m], state)
    return plain, fused, oracle


def _rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def test_fused_kernels_match_unfused_in_bf16_on_gpu(cuda_layout) -> None:  # noqa: ANN001
    """llama3_2_1b's layer and vocabulary shapes (2 layers), packed positions and an SFT-like loss mask:
    the fused model's logits, losses and gradients are as close to an fp32 oracle as the unfused bf16 model's."""
    from loong.llm.models.config import DenseModelConfig, RopeScaling

    acc, layout = cuda_layout
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = DenseModelConfig(num_layers=2, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
                           num_query_groups=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                           rope_theta=500000.0, rope_scaling=RopeScaling(factor=32.0), tie_word_embeddings=True)
    plain, fused, oracle = _fused_trio(acc, layout, cfg)
    b, s = 2, 2048
    tokens = torch.randint(0, cfg.vocab_size, (b, s), device="cuda")
    labels = torch.randint(0, cfg.vocab_size, (b, s), device="cuda")
    pos = torch.arange(s, device="cuda").expand(b, -1).clone()
    pos[1, 700:] -= 700  # a second packed document
    with torch.no_grad():
        lo, lp, lf = (m(tokens, pos, None).float() for m in (oracle, plain, fused))
    assert _rel_norm(lf, lo) <= 1.5 * _rel_norm(lp, lo) + 1e-4
    mask = (torch.rand(b, s, device="cuda") < 0.6).float()
    for weights in (torch.ones_like(mask) / mask.numel(), mask):  # pretraining's mean; SFT's masked sum
        out = []
        for m in (oracle, plain, fused):
            m.zero_grad(set_to_none=True)
            losses = m(tokens, pos, None, labels=labels)
            (losses.float() * weights).sum().backward()
            out.append((losses.detach().float(), {n: p.grad.float() for n, p in m.named_parameters()}))
        (eo, go), (ep, gp), (ef, gf) = out
        assert ef.shape == (b, s) and _rel_norm(ef, eo) <= 1.5 * _rel_norm(ep, eo) + 1e-4
        for name in go:
            assert _rel_norm(gf[name], go[name]) <= 1.5 * _rel_norm(gp[name], go[name]) + 1e-3, name


def test_fused_and_unfused_training_agree_on_gpu(tmp_path: Path) -> None:
    """A few steps of the tiny preset with fused_kernels=on and off: the same loss curve to bf16 noise."""
    from loong.llm.cli import main

    curves = {}
    for mode in ("on", "off"):
        code = main(["train", "train.steps=20", "train.progress=false", f"output_dir={tmp_path}", f"run_name={mode}",
                     "train.eval_interval=0", "train.eval_iters=0", "train.save_final=false",
                     f"model.fused_kernels={mode}"])
        assert code == 0
        curves[mode] = _train_losses(tmp_path / mode)
    on, off = curves["on"], curves["off"]
    assert abs(on[0] - off[0]) <= 0.01 * off[0]
    assert abs(on[-1] - off[-1]) <= 0.05 * off[-1] and on[-1] < 0.9 * on[0]


def test_packed_sft_rows_of_32k_tokens_run_through_flex_attention(cuda_layout) -> None:  # noqa: ANN001
    """A packed 32K-token row of 200 documents, forward and backward in bf16: the CUDA build picks FlexAttention
    (no [s, s] mask: a bool one alone would take 1 GiB per row, the scores in fp32 4 GiB per head), and its loss
    and gradients equal the per-document reference path's."""
    import numpy as np

    from loong.core.accelerators.capabilities import FLEX_ATTENTION
    from loong.core.config.schema import ParallelConfig
    from loong.core.engines.megatron.state import gather_full_state, load_full_state
    from loong.llm.models import build
    from loong.llm.models.attention import FlexSDPAttention
    from loong.llm.models.config import DenseModelConfig
    from loong.llm.sft.packing import Document, PackedSequences, make_sft_microbatch

    acc, layout = cuda_layout
    assert FLEX_ATTENTION in acc.capabilities()
    cfg = DenseModelConfig(num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8,
                           num_query_groups=2, vocab_size=512, max_position_embeddings=32768)
    tc = build.transformer_config(cfg, ParallelConfig(), torch.bfloat16, acc.megatron_config_overrides())
    caps = acc.capabilities()
    flex = build.build_gpt_model(cfg, tc, caps, True, True, layout.pg_collection).cuda()
    ref = build.build_gpt_model(cfg, tc, caps - {FLEX_ATTENTION}, True, True, layout.pg_collection).cuda()
    assert any(isinstance(m, FlexSDPAttention) for m in flex.modules())
    assert not any(isinstance(m, FlexSDPAttention) for m in ref.modules())
    load_full_state([ref], gather_full_state([flex]))
    seq = 32768
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 300, size=200)
    docs = [Document(rng.integers(0, 512, n + 1), np.ones(n, dtype=bool)) for n in lengths]
    packed = PackedSequences(docs, seq, packing=True, pad_id=0)
    batch = {k: v.cuda() for k, v in make_sft_microbatch([packed[0]]).items()}
    assert batch["attention_mask"].shape == (1, seq)
    results = []
    for model in (flex, ref):
        torch.cuda.reset_peak_memory_stats()
        losses = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        loss = (losses.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        loss.backward()
        grads = {n: p.grad.float().clone() if p.grad is not None else p.main_grad.float().clone()
                 for n, p in model.named_parameters() if p.grad is not None or hasattr(p, "main_grad")}
        model.zero_grad()
        results.append((float(loss), grads, torch.cuda.max_memory_allocated()))
    (flex_loss, flex_grads, flex_peak), (ref_loss, ref_grads, _) = results
    assert abs(flex_loss - ref_loss) <= 2e-2 * abs(ref_loss)
    for name, g in ref_grads.items():
        rel = ((flex_grads[name] - g).norm() / g.norm().clamp_min(1e-12)).item()
        assert rel <= 5e-2, (name, rel)
    assert flex_peak < 2**30  # under one dense [s, s] bool mask
