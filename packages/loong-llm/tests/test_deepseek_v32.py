"""DeepSeek-V3.2 (DeepSeek Sparse Attention): parity with transformers' ``DeepseekV32ForCausalLM`` (fp32 CPU, tiny
random model, YaRN, 1 dense + 2 MoE layers) with ``index_topk`` below the sequence length (sparse) and above it
(dense-equivalent); the absorbed (MQA-form) attention equals HF's MHA form; the indexer loss in both stages against
a plain-PyTorch transcription of the paper's formula (value and indexer gradient); the HF mapping and an export
transformers loads; the config translation; the presets; and TP=2 (sequence parallel) and CP=2 reproducing one rank's loss
and gradients (one 2-process gloo launch, ``workers/deepseek_v32_layouts.py``)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV32Config

from loong.core.accelerators import select_accelerator
from loong.core.config import compose_config
from loong.core.config.schema import ParallelConfig
from loong.core.engines.megatron.layout import world
from loong.core.engines.megatron.state import gather_full_state, load_full_state
from loong.core.errors import LoongError
from loong.llm.hf import model_config_from_hf
from loong.llm.hf_io import read_hf_folder, write_hf_folder
from loong.llm.models.build import build_gpt_model, transformer_config
from loong.llm.models.config import training_flops_per_token
from loong.llm.models.deepseek_v32.attention import DSAMLASelfAttention
from loong.llm.models.deepseek_v32.indexer import _TRACKER, IndexerLossAutoScaler, clear_indexer_loss_tracker
from loong.llm.models.hf_mapping import family_for_hf_config, hf_to_native, native_to_hf
from loong.llm.schema import LLMRunConfig

sys.path.insert(0, str(Path(__file__).parent))
from test_deepseek_v3 import _weights, randomize  # noqa: E402  (same folder: one weight randomiser for both)

TOL = 1e-5
SEQ = 40
WORKER = Path(__file__).parent / "workers" / "deepseek_v32_layouts.py"


def tiny_v32_config(vocab: int = 256, topk: int = 12, **kw) -> DeepseekV32Config:
    """DeepSeek-V3 at toy width plus an indexer of 8 heads × 16 channels (8 of them roped) keeping ``topk`` keys."""
    args = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=12,
        qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
        index_topk=topk, index_head_dim=16, index_n_heads=8, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
                         "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0},
    )
    args.update(kw)
    return DeepseekV32Config(**args)


def _hf_model(folder: Path, **kw):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_v32_config(**kw), dtype=torch.float32, attn_implementation="eager")
    randomize(_weights(model), seed=2)
    model.save_pretrained(folder)
    return model.eval()


@pytest.fixture(scope="module")
def hf_sparse(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "v32"
    return _hf_model(folder), folder


@pytest.fixture
def cpu():
    acc = select_accelerator("cpu")
    with world(acc) as layout:
        yield acc, layout


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _loong(cpu, model_cfg):
    acc, layout = cpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)
    tc = transformer_config(model_cfg, ParallelConfig(), torch.float32, {"use_cpu_initialization": True})
    return build_gpt_model(model_cfg, tc, acc.capabilities(), True, True, layout.pg_collection).eval()


def _loaded(cpu, folder: Path, **changes):
    _, state = read_hf_folder(folder)
    cfg = dataclasses.replace(model_config_from_hf(folder), **changes)
    model = _loong(cpu, cfg)
    load_full_state([model], hf_to_native(state, cfg))
    return model, cfg


def _inputs(vocab: int, seq: int = SEQ):
    tokens = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))
    return tokens, torch.arange(seq).unsqueeze(0).expand(2, -1)


# --- config -------------------------------------------------------------------------------------------------

def test_config_translation_both_ways():
    hf = tiny_v32_config(topk=8).to_dict()
    fam = family_for_hf_config(hf)
    cfg = fam.config_from_hf(hf)
    assert (fam.name, cfg.family, cfg.is_dsa, cfg.is_mla) == ("deepseek_v32", "deepseek_v32", True, True)
    assert (cfg.index_topk, cfg.index_head_dim, cfg.index_n_heads, cfg.first_k_dense_replace) == (8, 16, 8, 1)
    cfg.validate("model")
    out = fam.hf_config_dict(cfg, "float32")
    assert out["architectures"] == ["DeepseekV32ForCausalLM"]
    assert out["mlp_layer_types"] == ["dense", "sparse", "sparse"]
    assert fam.config_from_hf(out) == cfg
    with pytest.raises(LoongError, match="mlp_layer_types"):
        fam.config_from_hf({**hf, "mlp_layer_types": ["sparse", "dense", "sparse"]})
    with pytest.raises(LoongError, match="q_lora_rank"):
        dataclasses.replace(cfg, q_lora_rank=None).validate("model")
    with pytest.raises(LoongError, match="index_head_dim"):
        dataclasses.replace(cfg, index_head_dim=4).validate("model")
    # the indexer is in the parameter count and the FLOPs (sparse attention: top-k keys per query)
    v3 = dataclasses.replace(cfg, family="deepseek_v3")
    assert cfg.num_parameters() > v3.num_parameters()
    assert training_flops_per_token(cfg, 64) != training_flops_per_token(v3, 64)


# --- parity with transformers --------------------------------------------------------------------------------

@torch.no_grad()
def test_sparse_logits_and_loss_match_transformers(cpu, hf_sparse):
    """index_topk=12 < 40 tokens: the indexer's choice matters (the dense model's logits differ by > 1 %)."""
    hf, folder = hf_sparse
    loong, cfg = _loaded(cpu, folder)
    assert cfg.index_topk == 12 and cfg.dsa_stage == "sparse"
    tokens, pos = _inputs(cfg.vocab_size)
    ref = hf(tokens).logits
    got = loong(tokens, pos, None)
    assert _rel(got, ref) <= TOL
    losses = loong(tokens, pos, None, labels=tokens.roll(-1, dims=1))[:, :-1]
    hf_loss = hf(tokens, labels=tokens).loss
    assert abs(losses.mean().item() - hf_loss.item()) / hf_loss.item() <= TOL
    dense, _ = _loaded(cpu, folder, index_topk=SEQ)
    assert _rel(dense(tokens, pos, None), ref) > 1e-2


@torch.no_grad()
def test_dense_equivalent_topk_and_dense_warmup_match_transformers(cpu, hf_sparse, tmp_path):
    """index_topk >= S selects every causal key in transformers; Loong's dense warm-up attends to all of them too."""
    hf = _hf_model(tmp_path / "dense", topk=64)
    loong, cfg = _loaded(cpu, tmp_path / "dense")
    tokens, pos = _inputs(cfg.vocab_size)
    ref = hf(tokens).logits
    assert _rel(loong(tokens, pos, None), ref) <= TOL
    warm, _ = _loaded(cpu, tmp_path / "dense", index_topk=4, dsa_stage="dense_warmup")
    assert _rel(warm(tokens, pos, None), ref) <= TOL


# --- the indexer loss against the paper's formula --------------------------------------------------------------

def _reference_indexer_losses(hf, tokens: torch.Tensor, stage: str, topk: int) -> list[torch.Tensor]:
    """Per layer, the paper's indexer loss in plain PyTorch from transformers' weights (MHA-form MLA, full S x S):
    p_t = sum over heads of the main attention's probabilities (over the attended keys: all causal keys in the
    dense warm-up, the indexer's top-k S_t in the sparse stage), L1-normalised;
    loss = mean_t KL(p_t || softmax(I_t)) over the same keys, I[t, s] = sum_j w[t, j] relu(q_I[t, j]·k_I[s] / sqrt(D_I)),
    w = weights_proj(x) / sqrt(H_I). Differentiable w.r.t. the indexer's weights only (everything else detached)."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
        apply_rotary_pos_emb,
        apply_rotary_pos_emb_interleave,
    )

    inputs: list[torch.Tensor] = []
    hooks = [layer.self_attn.register_forward_pre_hook(lambda _m, _a, kw: inputs.append(kw["hidden_states"]),
                                                       with_kwargs=True) for layer in hf.model.layers]
    saved = [layer.self_attn.indexer.index_topk for layer in hf.model.layers]
    for layer in hf.model.layers:  # the dense warm-up's attention is dense: so are the layer inputs
        layer.self_attn.indexer.index_topk = topk if stage == "sparse" else 1 << 30
    with torch.no_grad():
        hf(tokens)
    for h, layer, k in zip(hooks, hf.model.layers, saved, strict=True):
        h.remove()
        layer.self_attn.indexer.index_topk = k
    b, s = tokens.shape
    pos = torch.arange(s)[None].expand(b, -1)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    losses = []
    for layer, x in zip(hf.model.layers, inputs, strict=True):
        a, ix = layer.self_attn, layer.self_attn.indexer
        cos, sin = hf.model.rotary_emb(x, pos)
        with torch.no_grad():
            q_resid = a.q_a_layernorm(a.q_a_proj(x))
            q = a.q_b_proj(q_resid).view(b, s, -1, a.qk_head_dim).transpose(1, 2)
            q_pass, q_rot = torch.split(q, [a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
            kv_pass, k_rot = torch.split(a.kv_a_proj_with_mqa(x), [a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
            k_pass = a.kv_a_layernorm(kv_pass).view(b, 1, s, a.kv_lora_rank)
            q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot.view(b, 1, s, -1), cos, sin)
            keys, _ = a.expand_kv(k_pass, k_rot)
            attn_scores = torch.cat([q_pass, q_rot], -1) @ keys.transpose(-1, -2) * a.scaling  # [B, H, S, S]
        qi = ix.wq_b(q_resid).view(b, s, ix.n_heads, ix.head_dim)
        ki = ix.k_norm(ix.wk(x)).unsqueeze(2)
        r = ix.qk_rope_head_dim
        qr, kr = apply_rotary_pos_emb(qi[..., :r], ki[..., :r], cos, sin, unsqueeze_dim=2)
        qi, ki = torch.cat([qr, qi[..., r:]], -1), torch.cat([kr, ki[..., r:]], -1).squeeze(2)
        w = ix.weights_proj(x) * ix.n_heads ** -0.5
        index = (torch.relu(torch.einsum("bthd,bsd->bths", qi, ki) * ix.head_dim ** -0.5) * w[..., None]).sum(2)
        keep = causal.expand(b, s, s)
        if stage == "sparse" and topk < s:
            top = index.detach().masked_fill(~keep, float("-inf")).topk(topk, dim=-1).indices
            keep = keep & torch.zeros(b, s, s, dtype=torch.bool).scatter(-1, top, True)
        p = torch.softmax(attn_scores.masked_fill(~keep[:, None], float("-inf")), -1).sum(1)
        p = p / p.sum(-1, keepdim=True)
        logq = torch.log_softmax(index.masked_fill(~keep, float("-inf")), -1)
        kl = torch.where(keep, torch.xlogy(p, p) - p * logq.masked_fill(~keep, 0.0), 0.0).sum(-1)
        losses.append(kl.mean())
    return losses


@pytest.mark.parametrize("stage", ["sparse", "dense_warmup"])
def test_indexer_loss_and_gradient_match_the_paper_formula(cpu, hf_sparse, stage):
    """The logged indexer loss (mean over layers) and the indexer's gradient (``indexer_loss_coeff`` × the loss's,
    through ``IndexerLossAutoScaler``) equal the reference; the LM loss adds nothing to the indexer's gradient."""
    hf, folder = hf_sparse
    coeff = 0.5
    loong, cfg = _loaded(cpu, folder, dsa_stage=stage, indexer_loss_coeff=coeff)
    tokens, pos = _inputs(cfg.vocab_size)
    hf.zero_grad()
    ref = _reference_indexer_losses(hf, tokens, stage, cfg.index_topk)
    (coeff * sum(ref)).backward()
    loong.train()
    clear_indexer_loss_tracker()
    IndexerLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    loong(tokens, pos, None, labels=tokens.roll(-1, dims=1)).mean().backward()
    assert _TRACKER["terms"] == cfg.num_layers
    logged = float(_TRACKER["sum"]) / _TRACKER["terms"]
    want = sum(r.item() for r in ref) / len(ref)
    assert want > 1e-3 and abs(logged - want) / want <= 1e-5
    clear_indexer_loss_tracker()
    params = dict(loong.named_parameters())
    for i in range(cfg.num_layers):
        for name in ("wq_b.weight", "wk.weight", "k_norm.weight", "weights_proj.weight"):
            got = params[f"decoder.layers.{i}.self_attention.indexer.{name}"].grad
            want_g = dict(hf.named_parameters())[f"model.layers.{i}.self_attn.indexer.{name}"].grad
            assert _rel(got, want_g) <= 1e-4, (i, name)


def _train_step(model, tokens, pos):
    """One training forward + backward: (LM loss, logged indexer loss, every gradient)."""
    model.train()
    clear_indexer_loss_tracker()
    IndexerLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    loss = model(tokens, pos, None, labels=tokens.roll(-1, dims=1)).mean()
    loss.backward()
    logged = float(_TRACKER["sum"]) / _TRACKER["terms"]
    clear_indexer_loss_tracker()
    return loss.item(), logged, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("stage", ["sparse", "dense_warmup"])
def test_triton_dsa_kernels_in_the_model_match_the_references(cpu, hf_sparse, stage, monkeypatch):
    """The model's DSA layers with the Triton kernels (Triton's interpreter on CPU) against the same layers with
    the plain-PyTorch references: the LM loss, the indexer loss and every gradient, with index_topk 12 < 40 tokens.
    This is the wiring the GPU takes (kernel lse into the indexer's KL target, -1 slots, the [b, s, h, d] layout);
    the kernels alone are tested in loong-kernels."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _, folder = hf_sparse
    tokens, pos = _inputs(256)
    runs = {}
    for backend in ("reference", "triton"):
        model, cfg = _loaded(cpu, folder, dsa_stage=stage)
        layers = [m for m in model.modules() if isinstance(m, DSAMLASelfAttention)]
        assert len(layers) == cfg.num_layers
        for layer in layers:
            layer.kernel_backend = backend
        runs[backend] = _train_step(model, tokens, pos)
    (ref_loss, ref_idx, ref_grads), (loss, idx, grads) = runs["reference"], runs["triton"]
    assert abs(loss - ref_loss) / ref_loss <= 1e-5 and abs(idx - ref_idx) / ref_idx <= 1e-5
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    for name, g in grads.items():
        assert torch.isfinite(g).all(), name
        assert _rel(g, ref_grads[name]) <= 1e-4, name


@pytest.mark.parametrize(("stage", "chunks", "recompute"), [("sparse", 2, "none"), ("sparse", 4, "full"),
                                                            ("dense_warmup", 2, "full")])
def test_head_chunked_attention_core_is_the_same_step(cpu, hf_sparse, stage, chunks, recompute):
    """model.dsa_head_chunks: the attention core per head group, recomputed in the backward (also inside megatron's
    full-layer recompute): the same LM loss, indexer loss (its target sums the groups' attention mass) and every
    gradient as one group."""
    _, folder = hf_sparse
    tokens, pos = _inputs(256)
    ref = _train_step(_loaded(cpu, folder, dsa_stage=stage)[0], tokens, pos)
    model, _ = _loaded(cpu, folder, dsa_stage=stage, dsa_head_chunks=chunks, recompute=recompute)
    assert {m.head_chunks for m in model.modules() if isinstance(m, DSAMLASelfAttention)} == {chunks}
    loss, idx, grads = _train_step(model, tokens, pos)
    # the KL is a small difference of sums: the groups' mass adds in another order (fp32)
    assert abs(loss - ref[0]) / ref[0] <= 1e-6 and abs(idx - ref[1]) / ref[1] <= 2e-5
    assert grads.keys() == ref[2].keys() and len(grads) > 10
    for name, g in grads.items():
        assert _rel(g, ref[2][name]) <= 1e-5, name


@pytest.mark.parametrize("chunk_elements", [1 << 26, 700])  # one chunk, and several queries' chunks
def test_indexer_target_and_kl_score_gathered_keys_as_every_key(monkeypatch, chunk_elements):
    """The sparse stage scores only each query's attended keys (their rows gathered); scoring every key and then
    gathering (the dense warm-up's way) gives the same target, KL and indexer gradients, empty (-1) slots
    included."""
    from loong.llm.models.deepseek_v32 import indexer as ix

    assert ix._gathers(2048, 65536) and not ix._gathers(40, 40)  # sparse stage at 64K / dense warm-up
    monkeypatch.setattr(ix, "_CHUNK_ELEMENTS", chunk_elements)
    g = torch.Generator().manual_seed(3)
    b, s, h, d, hi, di, k = 2, 48, 4, 24, 3, 16, 10
    query, kv = torch.randn(b, s, h, d, generator=g), torch.randn(b, s, d, generator=g)
    lse = torch.logsumexp(torch.randn(b, s, h, s, generator=g), -1)
    indices = torch.randint(0, s, (b, s, k), generator=g, dtype=torch.int32)
    indices[:, :, -2:] = -1
    q, kk = torch.randn(b, s, hi, di, generator=g), torch.randn(b, s, di, generator=g)
    w = torch.randn(b, s, hi, generator=g)
    results = []
    for gathered in (True, False):
        monkeypatch.setattr(ix, "_gathers", lambda n_keys, seq_kv, gathered=gathered: gathered)
        target = ix.normalise_target(ix.attention_mass(query, kv, indices, lse, 0.3))
        leaves = [t.clone().requires_grad_() for t in (q, kk, w)]
        loss = ix.indexer_kl(*leaves, indices, target)
        loss.backward()
        results.append((target, loss.detach(), *(t.grad for t in leaves)))
    assert (results[0][0][..., -2:] == 0).all() and results[0][1] > 0
    for got, want in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_head_chunks_must_divide_the_heads():
    with pytest.raises(LoongError, match=r"model\.dsa_head_chunks=3: must be >= 1 and divide num_attention_heads=128"):
        compose_config("loong.llm.configs", "pretrain", ["model=deepseek_v3_2_4l", "model.dsa_head_chunks=3"],
                       LLMRunConfig)


def test_dense_warmup_task_freezes_all_but_the_indexer():
    from loong.llm.models.deepseek_v32.indexer import freeze_all_but_indexer

    model = torch.nn.ModuleDict({"attn": torch.nn.ModuleDict({"indexer": torch.nn.Linear(2, 2)}),
                                 "mlp": torch.nn.Linear(2, 2)})
    model = torch.nn.ModuleDict({"decoder": model})
    assert freeze_all_but_indexer(model) == 6
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["decoder.attn.indexer.weight",
                                                                           "decoder.attn.indexer.bias"]


# --- HF mapping and export ------------------------------------------------------------------------------------

@torch.no_grad()
def test_export_loads_in_transformers_with_equal_logits(cpu, hf_sparse, tmp_path):
    """HF folder -> Loong -> (weights changed) -> HF folder: transformers loads every tensor, logits agree."""
    hf, folder = hf_sparse
    loong, cfg = _loaded(cpu, folder)
    full = gather_full_state([loong])
    randomize(sorted(full.items()), seed=3)
    load_full_state([loong], full)
    fam = family_for_hf_config(hf.config.to_dict())
    out = write_hf_folder(tmp_path / "export", fam.hf_config_dict(cfg, "float32"), native_to_hf(full, cfg))
    back, info = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens, pos = _inputs(cfg.vocab_size)
    assert _rel(back.eval()(tokens).logits, loong(tokens, pos, None)) <= TOL
    assert dataclasses.replace(model_config_from_hf(out), preset=cfg.preset) == cfg


def test_hf_loong_hf_bit_exact_with_mtp(hf_sparse):
    _, folder = hf_sparse
    _, state = read_hf_folder(folder)
    cfg = dataclasses.replace(model_config_from_hf(folder), mtp_num_layers=1)
    g = torch.Generator().manual_seed(4)
    for k, v in list(state.items()):  # an MTP module after the last layer, as DeepSeek's release stores it
        if k.startswith("model.layers.2."):
            state["model.layers.3." + k[len("model.layers.2."):]] = v + 0.01 * torch.randn(v.shape, generator=g)
    for name, shape in (("enorm.weight", (64,)), ("hnorm.weight", (64,)), ("shared_head.norm.weight", (64,)),
                        ("eh_proj.weight", (64, 128))):
        state[f"model.layers.3.{name}"] = torch.randn(shape, generator=g)
    state["model.layers.3.embed_tokens.weight"] = state["model.embed_tokens.weight"]
    state["model.layers.3.shared_head.head.weight"] = state["lm_head.weight"]
    native = hf_to_native(state, cfg)
    assert native["mtp.layers.0.transformer_layer.self_attention.indexer.wq_b.weight"].shape == (128, 32)
    for dtype in (torch.float32, torch.bfloat16):
        typed = {k: v.to(dtype) for k, v in state.items()}
        back = native_to_hf(hf_to_native(typed, cfg), cfg)
        assert set(back) == set(typed)
        assert all(back[k].dtype == dtype and torch.equal(back[k], t) for k, t in typed.items())
    del state["model.layers.1.self_attn.indexer.wk.weight"]
    with pytest.raises(LoongError, match="indexer.wk"):
        hf_to_native(state, cfg)


def test_mtp_layer_has_sparse_attention_and_its_indexer_loss(cpu, hf_sparse):
    """With a multi-token-prediction module its decoder layer is a DSA layer too: 3 + 1 indexer losses."""
    _, folder = hf_sparse
    cfg = dataclasses.replace(model_config_from_hf(folder), mtp_num_layers=1, moe_aux_loss_coeff=0.0)
    model = _loong(cpu, cfg).train()
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    IndexerLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    clear_indexer_loss_tracker()
    tokens, pos = _inputs(cfg.vocab_size)
    model(tokens, pos, None, labels=tokens.roll(-1, dims=1), loss_mask=torch.ones(tokens.shape)).mean().backward()
    assert _TRACKER["terms"] == 4
    clear_indexer_loss_tracker()
    grad = dict(model.named_parameters())["mtp.layers.0.mtp_model_layer.self_attention.indexer.wq_b.weight"].grad
    assert grad is not None and grad.abs().sum() > 0


# --- presets ----------------------------------------------------------------------------------------------

def _preset(name: str):
    cfg, _ = compose_config("loong.llm.configs", "pretrain", [f"model={name}"], LLMRunConfig)
    cfg.model.validate("model")
    return cfg.model


def test_deepseek_v3_2_preset_is_671b_plus_the_indexers():
    m = _preset("deepseek_v3_2")
    main = dataclasses.replace(m, mtp_num_layers=0)
    # DeepSeek-V3.2-Exp: DeepSeek-V3's 671B (37B active) plus 61 indexers (64 x 128 heads, 0.85B); the release
    # with its MTP module (which has an indexer too) counts ~684B here
    assert abs(main.num_parameters() - 671.9e9) / 671.9e9 <= 0.005, main.num_parameters()
    assert abs(m.num_parameters() - 684e9) / 684e9 <= 0.01, m.num_parameters()
    assert (m.num_layers, m.index_n_heads, m.index_head_dim, m.index_topk, m.q_lora_rank) == (61, 64, 128, 2048, 1536)
    assert m.family == "deepseek_v32" and m.dsa_stage == "sparse"


def test_deepseek_v3_2_4l_preset_fits_one_h200():
    m = _preset("deepseek_v3_2_4l")
    assert (m.num_layers, m.num_dense_layers, m.hidden_size, m.num_experts, m.family) == \
        (4, 1, 7168, 16, "deepseek_v32")
    assert m.num_parameters() * 16 < 105e9, m.num_parameters()  # bf16 weights + grads, fp32 Adam and master


# --- TP=2 (one 2-process gloo launch) --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def layouts(tmp_path_factory, run_workers) -> dict:  # noqa: ANN001
    folder = tmp_path_factory.mktemp("hf") / "tiny-v32"
    _hf_model(folder, vocab=512, topk=8)  # the packaged tokenizer's vocabulary; 8 of the 32-token windows
    out = tmp_path_factory.mktemp("dsv32_layouts") / "result.json"
    run_workers(WORKER, str(folder), str(out))
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "cp2"])
@pytest.mark.parametrize("stage", ["sparse", "warmup"])
def test_layout_reproduces_single_rank_loss_and_gradients(layouts: dict, stage: str, layout: str) -> None:
    loss = layouts["loss"]
    assert abs(loss[f"{stage}_{layout}"] - loss[f"{stage}_ref"]) / loss[f"{stage}_ref"] <= 1e-5
    assert layouts["grad_keys_equal"][f"{stage}_{layout}"]
    assert layouts["grad_err"][f"{stage}_{layout}"] <= 1e-5, layouts["grad_worst"][f"{stage}_{layout}"]
    assert layouts["indexer_grad_nonzero"][stage]
    # the dense warm-up trains only the indexers; the sparse stage everything
    trainable = layouts[f"{stage}_trainable"]
    assert ("other" not in trainable) == (stage == "warmup")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "cp2"])
def test_layout_training_tracks_single_rank_and_logs_indexer_loss(layouts: dict, layout: str) -> None:
    ref, got = layouts["train"]["ref"], layouts["train"][layout]
    assert max(abs(a - b) / b for a, b in zip(got, ref, strict=True)) <= 1e-4
    iref, igot = layouts["indexer_loss"]["ref"], layouts["indexer_loss"][layout]
    assert min(iref) > 0 and max(abs(a - b) / b for a, b in zip(igot, iref, strict=True)) <= 1e-4
