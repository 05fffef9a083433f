"""DeepSeek-V3: parity with transformers' ``DeepseekV3ForCausalLM`` (fp32 CPU, tiny random model with MLA, YaRN,
shared + routed experts, sigmoid group-limited routing with a non-zero expert bias, a dense first layer), the
multi-token-prediction loss against a plain-PyTorch reference built from transformers' modules, the HF mapping and
``convert`` both ways, the presets' sizes, and EP=2 / TP=2×EP=2 / ETP layouts reproducing one rank's loss and
gradients (one 2-process gloo launch, ``workers/deepseek_layouts.py``)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3Config

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
from loong.llm.models.fused import FusedKernels
from loong.llm.models.hf_mapping import family_for_hf_config, hf_to_native, native_to_hf
from loong.llm.schema import LLMRunConfig

TOL = 1e-5
SEQ = 40


def tiny_deepseek_v3_config(vocab: int = 256, layers: int = 3, mtp: int = 1, **kw) -> DeepseekV3Config:
    """Every DeepSeek-V3 feature at toy width: q/kv latents, YaRN with mscale, 8 experts in 4 groups (top-2 groups,
    top-4 experts), one shared expert, one dense first layer."""
    args = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=12,
        qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
        max_position_embeddings=256, num_nextn_predict_layers=mtp, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
                         "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0},
    )
    args.update(kw)
    return DeepseekV3Config(**args)


@pytest.fixture
def cpu():
    acc = select_accelerator("cpu")
    with world(acc) as layout:
        yield acc, layout


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@torch.no_grad()
def randomize(tensors, seed: int) -> None:
    """Weights that make every path matter: norm weights near 1 (LayerNorm biases, V3.2's indexer, near 0),
    routers large enough that no top-k is a near-tie, a non-zero expert bias (it changes which experts are
    picked, not their weights). test_deepseek_v32 uses it too."""
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors:
        noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
        if "norm" in name:
            t.copy_(0.1 * noise if name.endswith("bias") else 1.0 + 0.2 * noise)
        elif "e_score_correction_bias" in name or "expert_bias" in name:
            t.copy_(0.05 * noise)
        elif "gate.weight" in name or "router" in name:
            t.copy_(0.5 * noise)
        else:
            t.copy_(0.05 * noise)


def _weights(model):
    """Parameters and the routers' bias buffers (not the RoPE frequency buffers)."""
    return [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if "e_score_correction_bias" in n)]


def _hf_model(tmp_path: Path, **kw):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_deepseek_v3_config(**kw), dtype=torch.float32,
                                             attn_implementation="eager")
    randomize(_weights(model), seed=2)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    return model.eval(), folder


def _loong(cpu, model_cfg, fused: FusedKernels | None = None):
    acc, layout = cpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)
    tc = transformer_config(model_cfg, ParallelConfig(), torch.float32, {"use_cpu_initialization": True})
    return build_gpt_model(model_cfg, tc, acc.capabilities(), True, True, layout.pg_collection,
                           fused_kernels=fused).eval()


def _inputs(vocab: int, seq: int = SEQ):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (2, seq), generator=g)
    return tokens, torch.arange(seq).unsqueeze(0).expand(2, -1)


def test_config_from_hf_reads_every_field(tmp_path):
    _, folder = _hf_model(tmp_path)
    cfg = model_config_from_hf(folder)
    assert (cfg.family, cfg.num_layers, cfg.num_experts, cfg.moe_router_topk) == ("deepseek_v3", 3, 8, 4)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == \
        (32, 16, 16, 8, 12)
    assert (cfg.moe_shared_experts, cfg.first_k_dense_replace, cfg.moe_router_num_groups,
            cfg.moe_router_group_topk, cfg.moe_routed_scaling_factor) == (1, 1, 4, 2, 2.5)
    assert cfg.moe_router_score_function == "sigmoid" and cfg.moe_router_enable_expert_bias
    rs = cfg.rope_yarn
    assert cfg.rope_scaling is None and (rs.factor, rs.original_max_position_embeddings, rs.mscale_all_dim) == \
        (4.0, 64, 0.7)
    # transformers writes num_nextn_predict_layers=1 but no MTP weights: the model then has no MTP module
    assert cfg.mtp_num_layers == 0
    family = family_for_hf_config(read_hf_folder(folder)[0])
    again = family.config_from_hf(family.hf_config_dict(cfg, "float32"))
    assert dataclasses.replace(again, preset=cfg.preset) == cfg


@torch.no_grad()
def test_hf_to_loong_logits_and_loss(cpu, tmp_path):
    hf, folder = _hf_model(tmp_path)
    _, state = read_hf_folder(folder)
    assert state["model.layers.1.mlp.gate.e_score_correction_bias"].abs().sum() > 0
    model_cfg = model_config_from_hf(folder)
    loong = _loong(cpu, model_cfg)
    load_full_state([loong], hf_to_native(state, model_cfg))
    tokens, pos = _inputs(model_cfg.vocab_size)
    ref = hf(tokens)
    assert _rel(loong(tokens, pos, None), ref.logits) <= TOL
    labels = tokens.roll(-1, dims=1)
    losses = loong(tokens, pos, None, labels=labels)[:, :-1]
    hf_loss = hf(tokens, labels=tokens).loss
    assert abs(losses.mean().item() - hf_loss.item()) / hf_loss.item() <= TOL


@torch.no_grad()
def test_expert_bias_changes_routing_like_hf(cpu, tmp_path):
    """Zeroing the bias on both sides changes the logits identically: the bias steers selection in both."""
    hf, folder = _hf_model(tmp_path)
    _, state = read_hf_folder(folder)
    model_cfg = model_config_from_hf(folder)
    tokens, pos = _inputs(model_cfg.vocab_size)
    zeroed = {k: (torch.zeros_like(v) if "e_score_correction_bias" in k else v) for k, v in state.items()}
    hf.load_state_dict(zeroed, strict=False)
    loong = _loong(cpu, model_cfg)
    load_full_state([loong], hf_to_native(zeroed, model_cfg))
    with_bias = _loong(cpu, model_cfg)
    load_full_state([with_bias], hf_to_native(state, model_cfg))
    got = loong(tokens, pos, None)
    assert _rel(got, hf(tokens).logits) <= TOL
    assert _rel(with_bias(tokens, pos, None), got) > 1e-3


@torch.no_grad()
def test_fused_reference_modules_match(cpu, tmp_path):
    _, folder = _hf_model(tmp_path)
    _, state = read_hf_folder(folder)
    model_cfg = model_config_from_hf(folder)
    native = hf_to_native(state, model_cfg)
    plain, fused = _loong(cpu, model_cfg), _loong(cpu, model_cfg, FusedKernels.everything("reference"))
    load_full_state([plain], native)
    load_full_state([fused], native)
    tokens, pos = _inputs(model_cfg.vocab_size)
    assert _rel(fused(tokens, pos, None), plain(tokens, pos, None)) <= TOL


def test_grouped_mm_experts_equal_the_sequential_loop(cpu, tmp_path):
    """model.moe_grouped_mm with sigmoid group-limited routing, the expert bias and a shared expert: the loop's loss
    and every gradient."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_moe import assert_grouped_mm_equals_loop

    _, folder = _hf_model(tmp_path)
    _, state = read_hf_folder(folder)
    model_cfg = model_config_from_hf(folder)
    assert_grouped_mm_equals_loop(lambda cfg: _loong(cpu, cfg), model_cfg, hf_to_native(state, model_cfg),
                                  *_inputs(model_cfg.vocab_size))


def _mtp_model(cpu, tmp_path):
    """(transformers model, Loong model with one random MTP module loaded from the same weights, native state)."""
    hf, folder = _hf_model(tmp_path)
    _, state = read_hf_folder(folder)
    # no sequence-wise balance loss: its gradient would reach eh_proj through the MTP layer's router too
    model_cfg = dataclasses.replace(model_config_from_hf(folder), mtp_num_layers=1, moe_aux_loss_coeff=0.0)
    loong = _loong(cpu, model_cfg)
    full = gather_full_state([loong])
    mtp = {k: v for k, v in full.items() if k.startswith("mtp.")}
    randomize(sorted(mtp.items()), seed=5)
    native = {**hf_to_native(state, dataclasses.replace(model_cfg, mtp_num_layers=0)), **mtp}
    load_full_state([loong], native)
    return hf, loong, model_cfg, native


def _mtp_reference_loss(hf, native: dict, cfg, tokens: torch.Tensor, eh_proj: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's MTP module in plain PyTorch (transformers' decoder layer and RMSNorm): the main model's final
    hidden state h_i and the embedding of token i+1, each RMS-normed, concatenated [emb, h], projected 2d -> d, one
    decoder layer, the shared norm and head; cross-entropy against token i+2 (the last two positions masked)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    hf_cfg = hf.config
    layer = DeepseekV3DecoderLayer(hf_cfg, layer_idx=cfg.num_layers).eval()
    hf_state = native_to_hf(native, cfg)
    pre = f"model.layers.{cfg.num_layers}."
    own = {k[len(pre):]: v for k, v in hf_state.items()
           if k.startswith(pre) and not k[len(pre):].startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed"))}
    ex = [f"mlp.experts.{e}." for e in range(cfg.num_experts)]  # the files' per-expert tensors, fused in memory
    own["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([own.pop(p + "gate_proj.weight"),
                                                              own.pop(p + "up_proj.weight")]) for p in ex])
    own["mlp.experts.down_proj"] = torch.stack([own.pop(p + "down_proj.weight") for p in ex])
    layer.load_state_dict(own)
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = DeepseekV3RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        norms[name].weight.data.copy_(hf_state[pre + name + ".weight"])
    b, s = tokens.shape
    h = hf.model(tokens).last_hidden_state
    nxt = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)  # megatron's roll: 0 fills the end
    e = hf.model.embed_tokens(nxt)
    x = F.linear(torch.cat([norms["enorm"](e), norms["hnorm"](h)], -1), eh_proj)
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
    x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=hf.model.rotary_emb(x, pos))
    logits = hf.lm_head(norms["shared_head.norm"](x))
    target = tokens[:, 2:]
    ce = F.cross_entropy(logits[:, :-2].reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum")
    return ce / target.numel()


def test_mtp_loss_matches_plain_pytorch_reference(cpu, tmp_path):
    """The MTP loss megatron logs equals the reference; its gradient (scale·loss, through MTPLossAutoScaler) reaches
    the MTP module while the returned per-token loss stays the main LM loss (logits unchanged by MTP)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    hf, loong, cfg, native = _mtp_model(cpu, tmp_path)
    tokens, pos = _inputs(cfg.vocab_size)
    w = torch.nn.Parameter(native["mtp.layers.0.eh_proj.weight"].clone())
    ref = _mtp_reference_loss(hf, native, cfg, tokens, w)
    (cfg.mtp_loss_scaling_factor * ref).backward()  # megatron: scale / mtp_num_layers, through MTPLossAutoScaler
    with torch.no_grad():
        assert _rel(loong(tokens, pos, None), hf(tokens).logits) <= TOL
    loong.train()
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    labels = tokens.roll(-1, dims=1)
    mask = torch.ones_like(tokens, dtype=torch.float32)
    mask[:, -1] = 0  # the rolled-in label of the last position is not a real token (as pretraining's loss mask)
    losses = loong(tokens, pos, None, labels=labels, loss_mask=mask)
    logged = MTPLossLoggingHelper.tracker["loss_values"][0]
    assert abs(logged.item() - ref.item()) / ref.item() <= TOL
    main = (losses * mask).sum() / mask.sum()
    main.backward()
    grad = dict(loong.named_parameters())["mtp.layers.0.eh_proj.weight"].grad
    assert _rel(grad, w.grad) <= 1e-4


@pytest.mark.parametrize("per_token", [False, True])
def test_fused_loss_with_mtp_equals_megatrons_path(cpu, tmp_path, per_token):
    """With MTP, the fused loss (reference backend on CPU) gives megatron's unfused path's per-token main loss,
    logged MTP loss and every gradient: the MTP layers' rolled labels and mask, and their MTPLossAutoScaler terms
    (also with calculate_per_token_loss), are reproduced without their [s, b, V] logits."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    _, _, cfg, native = _mtp_model(cpu, tmp_path)
    tokens, pos = _inputs(cfg.vocab_size)
    labels = tokens.roll(-1, dims=1)
    mask = torch.ones_like(tokens, dtype=torch.float32)
    mask[:, -1] = 0
    mask[0, 5:9] = 0  # masked positions inside the sequence roll into the MTP layers' masks too
    runs = []
    for fused in (None, FusedKernels(cross_entropy=True, backend="reference")):
        model = _loong(cpu, cfg, fused)
        model.config.calculate_per_token_loss = per_token
        load_full_state([model], native)
        model.train()
        MTPLossLoggingHelper.clean_metrics_in_tracker()
        MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        losses = model(tokens, pos, None, labels=labels, loss_mask=mask)
        logged = MTPLossLoggingHelper.tracker["loss_values"][0].item()
        ((losses * mask).sum() / mask.sum()).backward()
        runs.append((losses.detach(), logged, {n: p.grad.clone() for n, p in model.named_parameters()
                                                if p.grad is not None}))
        MTPLossLoggingHelper.clean_metrics_in_tracker()
    (ref_losses, ref_logged, ref_grads), (losses, logged, grads) = runs
    assert _rel(losses, ref_losses) <= TOL and abs(logged - ref_logged) / ref_logged <= TOL
    assert grads.keys() == ref_grads.keys() and any(k.startswith("mtp.") for k in grads)
    for name, g in grads.items():
        assert _rel(g, ref_grads[name]) <= 1e-5, name


@torch.no_grad()
def test_loong_to_hf_export_loads_in_transformers(cpu, tmp_path):
    hf, loong, cfg, _ = _mtp_model(cpu, tmp_path)
    family = family_for_hf_config(hf.config.to_dict())
    full = gather_full_state([loong])
    randomize(sorted(full.items()), seed=3)
    load_full_state([loong], full)
    out = write_hf_folder(tmp_path / "export", family.hf_config_dict(cfg, "float32"),
                          native_to_hf(gather_full_state([loong]), cfg))
    back, info = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"], info
    # transformers has no MTP module: the MTP tensors (model.layers.3.*) are the only ones it leaves out
    assert info["unexpected_keys"] and all(k.startswith("model.layers.3.") for k in info["unexpected_keys"])
    tokens, pos = _inputs(cfg.vocab_size)
    assert _rel(back.eval()(tokens).logits, loong(tokens, pos, None)) <= TOL
    again = model_config_from_hf(out)
    assert again.mtp_num_layers == 1
    assert dataclasses.replace(again, preset=cfg.preset) == cfg
    assert AutoConfig.from_pretrained(out).num_nextn_predict_layers == 1


def test_hf_loong_hf_bit_exact_with_mtp(cpu, tmp_path):
    _, _, cfg, native = _mtp_model(cpu, tmp_path)
    hf_state = native_to_hf(native, cfg)
    assert torch.equal(hf_state["model.layers.3.embed_tokens.weight"], hf_state["model.embed_tokens.weight"])
    for dtype in (torch.float32, torch.bfloat16):
        typed = {k: v.to(dtype) for k, v in hf_state.items()}
        back = native_to_hf(hf_to_native(typed, cfg), cfg)
        assert set(back) == set(typed)
        assert all(back[k].dtype == dtype and torch.equal(back[k], t) for k, t in typed.items())


def test_config_errors():
    base = tiny_deepseek_v3_config().to_dict()
    fam = family_for_hf_config(base)
    assert fam.name == "deepseek_v3"
    with pytest.raises(LoongError, match="scoring_func"):
        fam.config_from_hf({**base, "scoring_func": "softmax"})
    with pytest.raises(LoongError, match="rope_interleave"):
        fam.config_from_hf({**base, "rope_interleave": False})
    with pytest.raises(LoongError, match="norm_topk_prob"):
        fam.config_from_hf({**base, "norm_topk_prob": False})
    cfg = fam.config_from_hf(base)
    with pytest.raises(LoongError, match="group-limited routing"):
        dataclasses.replace(cfg, moe_router_group_topk=3).validate("model")
    from loong.llm.models.config import check_model_layout

    with pytest.raises(LoongError, match="does not divide the model's 8 experts"):
        check_model_layout(cfg, 1, 1, 32, ep=3)


# --- presets --------------------------------------------------------------------------------------------

def _preset(name: str):
    cfg, _ = compose_config("loong.llm.configs", "pretrain", [f"model={name}"], LLMRunConfig)
    cfg.model.validate("model")
    return cfg.model


def test_deepseek_v3_preset_is_671b_with_37b_active():
    m = _preset("deepseek_v3")
    main = dataclasses.replace(m, mtp_num_layers=0)
    # DeepSeek-V3: 671B total, 37B activated per token; the released checkpoint adds a 14B MTP module (685B)
    assert abs(main.num_parameters() - 671e9) / 671e9 <= 0.01, main.num_parameters()
    assert abs(main.num_parameters(active=True) - 37e9) / 37e9 <= 0.03, main.num_parameters(active=True)
    assert abs(m.num_parameters() - 685e9) / 685e9 <= 0.01, m.num_parameters()
    assert (m.num_layers, m.first_k_dense_replace, m.num_experts, m.moe_router_topk, m.mtp_num_layers) == \
        (61, 3, 256, 8, 1)
    assert training_flops_per_token(m, 4096) > 6 * 37e9


def test_deepseek_v3_4l_preset_fits_one_h200():
    m = _preset("deepseek_v3_4l")
    assert (m.num_layers, m.num_dense_layers, m.hidden_size, m.kv_lora_rank) == (4, 1, 7168, 512)
    # bf16 weights and grads + fp32 Adam moments and master weights: 16 bytes per parameter
    assert m.num_parameters() * 16 < 105e9, m.num_parameters()


# --- layouts (one 2-process gloo launch) ---------------------------------------------------------------

def build_tiny_deepseek_v3_hf(out: Path) -> Path:
    """The layout checks' HF folder: a 3-layer (1 dense + 2 MoE) DeepseekV3ForCausalLM plus one MTP module, at the
    packaged tokenizer's vocab (the conftest's ``moe_family_layouts`` launch uses it)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_deepseek_v3_config(vocab=512), dtype=torch.float32)
    randomize(_weights(model), seed=4)
    model.save_pretrained(out)
    cfg, state = read_hf_folder(out)
    g = torch.Generator().manual_seed(6)
    for k, v in list(state.items()):  # an MTP module as DeepSeek's release stores it, after the last layer
        if k.startswith("model.layers.2."):
            state["model.layers.3." + k[len("model.layers.2."):]] = v + 0.01 * torch.randn(v.shape, generator=g)
    for name, shape in (("enorm.weight", (64,)), ("hnorm.weight", (64,)), ("shared_head.norm.weight", (64,))):
        state[f"model.layers.3.{name}"] = 1.0 + 0.1 * torch.randn(shape, generator=g)
    state["model.layers.3.eh_proj.weight"] = 0.05 * torch.randn(64, 128, generator=g)
    state["model.layers.3.embed_tokens.weight"] = state["model.embed_tokens.weight"]
    state["model.layers.3.shared_head.head.weight"] = state["lm_head.weight"]
    write_hf_folder(out, cfg, state)
    return out


@pytest.fixture(scope="module")
def layouts(moe_family_layouts: dict) -> dict:
    return moe_family_layouts["deepseek_v3"]


@pytest.fixture(scope="module")
def tiny_deepseek_v3_hf(moe_family_layouts: dict) -> Path:
    return Path(moe_family_layouts["hf"]["deepseek_v3"])


def _rel_f(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2", "tp2ep2", "tp2etp1", "cp2"])
def test_layout_loss_and_gradients_match_single_rank(layouts: dict, layout: str) -> None:
    assert layout not in layouts["errors"], layouts["errors"][layout]
    assert _rel_f(layouts["loss"][layout], layouts["loss"]["ref"]) <= 1e-5
    assert layouts["grad_keys_equal"][layout]
    assert layouts["grad_err"][layout] <= 1e-5, layouts["grad_worst"][layout]
    assert layouts["mtp_grad_nonzero"][layout]


@pytest.mark.slow
def test_training_tracks_single_rank_and_moves_the_expert_bias(layouts: dict) -> None:
    ref, got = layouts["train"]["ref"], layouts["train"]["tp2ep2"]
    assert len(ref) == len(got) == 3
    assert max(_rel_f(a, b) for a, b in zip(got, ref, strict=True)) <= 1e-4
    assert ref[-1] < ref[0]
    assert layouts["mtp_loss"]["ref"] > 0 and _rel_f(layouts["mtp_loss"]["tp2ep2"], layouts["mtp_loss"]["ref"]) <= 1e-4
    assert layouts["bias_moved"]["ref"] and layouts["bias_moved"]["tp2ep2"]
    assert layouts["bias_err"] <= 1e-6


@pytest.mark.slow
def test_cp2_training_tracks_single_rank_and_logs_the_mtp_loss(layouts: dict) -> None:
    """CP=2's 3 steps and its logged MTP loss (each CP rank's share of the sequences' mean, averaged over DP x CP)
    follow one rank's."""
    ref, got = layouts["train"]["ref"], layouts["train"]["cp2"]
    assert max(_rel_f(a, b) for a, b in zip(got, ref, strict=True)) <= 1e-4
    assert _rel_f(layouts["mtp_loss"]["cp2"], layouts["mtp_loss"]["ref"]) <= 1e-4


@pytest.mark.slow
def test_convert_round_trip_with_mtp(layouts: dict, tiny_deepseek_v3_hf: Path, tmp_path) -> None:
    from loong.llm.cli import main

    loong, back = tmp_path / "loong", tmp_path / "back"
    assert main(["convert", str(tiny_deepseek_v3_hf), str(loong)]) == 0
    assert main(["convert", str(loong), str(back)]) == 0
    _, a = read_hf_folder(tiny_deepseek_v3_hf)
    _, b = read_hf_folder(back)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    # the TP=2 x EP=2 run's train.save_hf equals the single-rank run's
    _, ref = read_hf_folder(layouts["hf_exports"]["ref"])
    _, got = read_hf_folder(layouts["hf_exports"]["tp2ep2"])
    assert set(got) == set(ref) == set(a)
    assert max(_rel(got[k], ref[k]) for k in ref if ref[k].abs().max() > 0) <= 1e-4
