"""Qwen3-MoE: parity with transformers (fp32 CPU, tiny random model), the HF mapping both ways, ``convert``
both ways, and EP=2 / TP=2 / ETP layouts reproducing the single-rank loss and gradients (one 2-process gloo
launch shared with DeepSeek-V3's, ``workers/moe_layouts.py`` through ``moe_family_layouts.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig

from loong.core.accelerators import select_accelerator
from loong.core.config.schema import ParallelConfig
from loong.core.engines.megatron.layout import world
from loong.core.engines.megatron.state import gather_full_state, load_full_state
from loong.core.errors import LoongError
from loong.llm.hf_io import read_hf_folder, write_hf_folder
from loong.llm.models.build import build_gpt_model, transformer_config
from loong.llm.models.fused import FusedKernels
from loong.llm.models.hf_mapping import family_for_hf_config, hf_to_native, native_to_hf

TOL = 1e-5


def tiny_qwen3_moe_config(vocab: int = 256, layers: int = 2, norm_topk_prob: bool = True) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=vocab, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=norm_topk_prob, max_position_embeddings=512, rms_norm_eps=1e-6,
        router_aux_loss_coef=0.01,
    )  # fmt: skip


@pytest.fixture
def cpu():  # per test: ``convert`` below sets up and tears down its own world of one
    acc = select_accelerator("cpu")
    with world(acc) as layout:
        yield acc, layout


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@torch.no_grad()
def _randomize(tensors, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors:
        noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
        # routers a little larger than the rest, so the top-k choice is not a near-tie anywhere
        t.copy_(1.0 + 0.2 * noise if "norm" in name else (0.5 if "gate.weight" in name or "router" in name
                                                              else 0.05) * noise)


def _hf_model(tmp_path: Path, norm_topk_prob: bool = True):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(norm_topk_prob=norm_topk_prob),
                                             dtype=torch.float32, attn_implementation="eager")
    _randomize(model.named_parameters(), seed=2)
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


def _inputs(vocab: int):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (2, 48), generator=g)
    return tokens, torch.arange(48).unsqueeze(0).expand(2, -1)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@torch.no_grad()
def test_hf_to_loong_logits_and_loss(cpu, tmp_path, norm_topk_prob):
    hf, folder = _hf_model(tmp_path, norm_topk_prob)
    hf_cfg, state = read_hf_folder(folder)
    assert any(".mlp.experts.7.down_proj.weight" in k for k in state)  # per-expert tensors in the files
    model_cfg = family_for_hf_config(hf_cfg).config_from_hf(hf_cfg)
    assert (model_cfg.family, model_cfg.num_experts, model_cfg.moe_router_topk) == ("qwen3_moe", 8, 2)
    assert model_cfg.norm_topk_prob is norm_topk_prob and model_cfg.moe_aux_loss_coeff == 0.01
    loong = _loong(cpu, model_cfg)
    load_full_state([loong], hf_to_native(state, model_cfg))
    tokens, pos = _inputs(model_cfg.vocab_size)
    ref = hf(tokens)
    assert _rel(loong(tokens, pos, None), ref.logits) <= TOL
    # the LM loss: megatron's per-token losses [b, s] against HF's shifted mean
    labels = tokens.roll(-1, dims=1)
    losses = loong(tokens, pos, None, labels=labels)[:, :-1]
    hf_loss = hf(tokens, labels=tokens).loss
    assert abs(losses.mean().item() - hf_loss.item()) / hf_loss.item() <= TOL


@torch.no_grad()
def test_fused_reference_modules_match(cpu, tmp_path):
    """The fused-kernel wiring (reference backend on CPU) reaches the experts too: same logits."""
    _, folder = _hf_model(tmp_path)
    hf_cfg, state = read_hf_folder(folder)
    model_cfg = family_for_hf_config(hf_cfg).config_from_hf(hf_cfg)
    native = hf_to_native(state, model_cfg)
    plain, fused = _loong(cpu, model_cfg), _loong(cpu, model_cfg, FusedKernels.everything("reference"))
    load_full_state([plain], native)
    load_full_state([fused], native)
    tokens, pos = _inputs(model_cfg.vocab_size)
    assert _rel(fused(tokens, pos, None), plain(tokens, pos, None)) <= TOL


def assert_grouped_mm_equals_loop(build, model_cfg, native: dict, tokens: torch.Tensor, pos: torch.Tensor) -> None:  # noqa: ANN001
    """``build(model_cfg)`` with ``moe_grouped_mm`` off and on, both loaded with ``native``: the grouped experts give the
    loop's loss and every gradient (also test_deepseek_v3's)."""
    import dataclasses

    from loong.llm.models.grouped_experts import GroupedMMExperts

    results = []
    for grouped in (False, True):
        model = build(dataclasses.replace(model_cfg, moe_grouped_mm=grouped)).train()
        experts = {type(m) for m in model.modules() if type(m).__name__.endswith(("SequentialMLP", "MMExperts"))}
        assert (GroupedMMExperts in experts) is grouped and len(experts) == 1
        load_full_state([model], native)
        loss = model(tokens, pos, None, labels=tokens.roll(-1, dims=1)).mean()
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loop_loss, loop_grads), (loss, grads) = results
    assert abs(loss - loop_loss) / loop_loss <= 1e-6
    assert grads.keys() == loop_grads.keys() and sum(".local_experts." in n for n in grads) >= 4
    for name, g in grads.items():
        assert _rel(g, loop_grads[name]) <= 1e-5, name


@pytest.mark.parametrize("fused", [None, FusedKernels.everything("reference")])
def test_grouped_mm_experts_equal_the_sequential_loop(cpu, tmp_path, fused):
    """model.moe_grouped_mm: the experts as two torch._grouped_mm calls (also with the fused activation module)
    give the loop's loss and every gradient, with the same parameters (one state dict loads into both)."""
    _, folder = _hf_model(tmp_path)
    hf_cfg, state = read_hf_folder(folder)
    model_cfg = family_for_hf_config(hf_cfg).config_from_hf(hf_cfg)
    assert_grouped_mm_equals_loop(lambda cfg: _loong(cpu, cfg, fused), model_cfg, hf_to_native(state, model_cfg),
                                  *_inputs(model_cfg.vocab_size))


@pytest.mark.gpu
def test_cuda_grouped_mm_experts_match_the_loop(tmp_path):
    """On CUDA in bf16 (torch._grouped_mm's GPU kernel): the grouped experts' loss and gradients follow the loop's
    within bf16 rounding (the products accumulate in another order)."""
    import dataclasses

    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not torch.cuda.is_available():
        pytest.fail("gpu tests need CUDA")
    _, folder = _hf_model(tmp_path)
    hf_cfg, state = read_hf_folder(folder)
    model_cfg = family_for_hf_config(hf_cfg).config_from_hf(hf_cfg)
    native = hf_to_native(state, model_cfg)
    tokens, pos = (t.cuda() for t in _inputs(model_cfg.vocab_size))
    acc = select_accelerator("cuda")
    results = []
    with world(acc) as layout:
        for grouped in (False, True):
            cfg = dataclasses.replace(model_cfg, moe_grouped_mm=grouped)
            model_parallel_cuda_manual_seed(0)
            tc = transformer_config(cfg, ParallelConfig(), torch.bfloat16, {"use_cpu_initialization": True})
            model = build_gpt_model(cfg, tc, acc.capabilities(), True, True, layout.pg_collection)
            load_full_state([model], native)
            model = model.to(device="cuda", dtype=torch.bfloat16).train()
            loss = model(tokens, pos, None, labels=tokens.roll(-1, dims=1)).float().mean()
            loss.backward()
            results.append((loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (loop_loss, loop_grads), (loss, grads) = results
    assert abs(loss - loop_loss) / loop_loss <= 1e-2
    for name, g in grads.items():
        assert _rel(g, loop_grads[name]) <= 5e-2, name


def test_grouped_mm_experts_refuse_fp8():
    from loong.core.config import compose_config
    from loong.llm.pretrain import PretrainTask
    from loong.llm.schema import LLMRunConfig

    cfg, _ = compose_config("loong.llm.configs", "pretrain", ["model=qwen3_30b_a3b_4l", "model.moe_grouped_mm=true",
                                                              "precision.fp8=tensorwise"], LLMRunConfig)
    with pytest.raises(LoongError, match=r"model\.moe_grouped_mm=true .* precision\.fp8=tensorwise would not reach"):
        PretrainTask.check_config(cfg)


def test_grouped_mm_auto_follows_the_accelerator_and_fp8(cpu):
    """``auto``: grouped where the accelerator reports ``grouped_mm`` (CUDA sm90+), the loop elsewhere and under FP8
    (its recipes reach the experts only through the loop's linear layers); true and false are taken as said."""
    from loong.core.config import compose_config
    from loong.llm.models.grouped_experts import GroupedMMExperts, uses_grouped_mm
    from loong.llm.pretrain import PretrainTask
    from loong.llm.schema import LLMRunConfig

    def model(*overrides: str):
        cfg, _ = compose_config("loong.llm.configs", "pretrain", ["model=qwen3_30b_a3b_4l", *overrides], LLMRunConfig)
        PretrainTask.check_config(cfg)
        return cfg.model

    auto, fp8 = model(), model("precision.fp8=tensorwise")
    assert auto.moe_grouped_mm == "auto" and fp8.moe_grouped_mm is False
    assert uses_grouped_mm(auto, {"grouped_mm"}) and not uses_grouped_mm(auto, set())
    assert not uses_grouped_mm(fp8, {"grouped_mm"})
    assert uses_grouped_mm(model("model.moe_grouped_mm=true"), set())
    assert not uses_grouped_mm(model("model.moe_grouped_mm=false"), {"grouped_mm"})
    assert not uses_grouped_mm(model("model=llama3_2_1b"), {"grouped_mm"})  # dense: nothing to group
    # the built model follows the same answer; the CPU plugin does not report grouped_mm (the loop)
    acc, layout = cpu
    assert "grouped_mm" not in acc.capabilities()
    tiny = family_for_hf_config(tiny_qwen3_moe_config().to_dict()).config_from_hf(tiny_qwen3_moe_config().to_dict())
    tc = transformer_config(tiny, ParallelConfig(), torch.float32, {"use_cpu_initialization": True})
    for caps, grouped in (({"grouped_mm"}, True), (acc.capabilities(), False)):
        gpt = build_gpt_model(tiny, tc, caps, True, True, layout.pg_collection)
        assert any(isinstance(m, GroupedMMExperts) for m in gpt.modules()) == grouped


@torch.no_grad()
def test_loong_to_hf_export_loads_in_transformers(cpu, tmp_path):
    _, folder = _hf_model(tmp_path)
    hf_cfg, _ = read_hf_folder(folder)
    family = family_for_hf_config(hf_cfg)
    model_cfg = family.config_from_hf(hf_cfg)
    loong = _loong(cpu, model_cfg)  # megatron's init, then random: independent of HF
    full = gather_full_state([loong])
    _randomize(sorted(full.items()), seed=3)
    load_full_state([loong], full)
    out = write_hf_folder(tmp_path / "export", family.hf_config_dict(model_cfg, "float32"),
                          native_to_hf(gather_full_state([loong]), model_cfg))
    hf, info = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens, pos = _inputs(model_cfg.vocab_size)
    assert _rel(hf.eval()(tokens).logits, loong(tokens, pos, None)) <= TOL
    assert family.config_from_hf(AutoConfig.from_pretrained(out).to_dict()) == model_cfg


def test_aux_loss_reaches_the_router_only_through_its_gradient(cpu, tmp_path):
    """The load-balancing loss is not in the returned LM loss but its gradient (MoEAuxLossAutoScaler) reaches
    the routers (and everything under them), not the experts; it is recorded for ``moe_aux_loss``."""
    import dataclasses

    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    _, folder = _hf_model(tmp_path)
    hf_cfg, state = read_hf_folder(folder)
    with_aux = family_for_hf_config(hf_cfg).config_from_hf(hf_cfg)
    no_aux = dataclasses.replace(with_aux, moe_aux_loss_coeff=0.0)
    tokens, pos = _inputs(with_aux.vocab_size)
    grads, losses = {}, {}
    for name, cfg in (("aux", with_aux), ("none", no_aux)):
        model = _loong(cpu, cfg).train()
        load_full_state([model], hf_to_native(state, cfg))
        get_moe_metrics_tracker().clear()
        loss = model(tokens, pos, None, labels=tokens.roll(-1, dims=1)).mean()
        loss.backward()
        losses[name] = loss.item()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
        recorded = get_moe_metrics_tracker().metrics.get("load_balancing_loss")
        if name == "aux":
            assert recorded is not None and bool((recorded.values > 0.5).all())  # ~1: one value per layer
    assert losses["aux"] == losses["none"]
    router = "decoder.layers.0.mlp.router.weight"
    assert not torch.equal(grads["aux"][router], grads["none"][router])
    expert = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"
    assert torch.equal(grads["aux"][expert], grads["none"][expert])


def test_hf_loong_hf_bit_exact(tmp_path):
    _, folder = _hf_model(tmp_path)
    hf_cfg, state = read_hf_folder(folder)
    model_cfg = family_for_hf_config(hf_cfg).config_from_hf(hf_cfg)
    for dtype in (torch.float32, torch.bfloat16):
        typed = {k: v.to(dtype) for k, v in state.items()}
        back = native_to_hf(hf_to_native(typed, model_cfg), model_cfg)
        assert set(back) == set(typed)
        assert all(back[k].dtype == dtype and torch.equal(back[k], t) for k, t in typed.items())


def test_config_errors(tmp_path):
    base = tiny_qwen3_moe_config().to_dict()
    fam = family_for_hf_config(base)
    with pytest.raises(LoongError, match="mlp_only_layers"):
        fam.config_from_hf({**base, "mlp_only_layers": [0]})
    with pytest.raises(LoongError, match="decoder_sparse_step"):
        fam.config_from_hf({**base, "decoder_sparse_step": 2})
    cfg = fam.config_from_hf(base)
    from loong.llm.models.config import check_model_layout

    with pytest.raises(LoongError, match="does not divide the model's 8 experts"):
        check_model_layout(cfg, 1, 1, 32, ep=3)
    dense = family_for_hf_config({"model_type": "qwen3"})
    with pytest.raises(LoongError, match="dense models have no experts"):
        check_model_layout(dense.config_from_hf({**base, "model_type": "qwen3"}), 1, 1, 32, ep=2)


# --- layouts (one 2-process gloo launch) ---------------------------------------------------------------

def build_tiny_moe_hfs(root: Path) -> tuple[Path, Path]:
    """The layout checks' HF folders: a 2-layer, 8-expert, top-2 Qwen3MoeForCausalLM and a dense 2-layer Qwen3, at the
    packaged tokenizer's vocab size (the conftest's ``moe_family_layouts`` launch uses them)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    moe = root / "tiny-qwen3-moe"
    AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(vocab=512), dtype=torch.float32).save_pretrained(moe)
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 head_dim=16, num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
                                 tie_word_embeddings=False)).save_pretrained(root / "qwen3")
    return moe, root / "qwen3"


@pytest.fixture(scope="module")
def layouts(moe_family_layouts: dict) -> dict:
    return moe_family_layouts["qwen3_moe"]


@pytest.fixture(scope="module")
def tiny_qwen3_moe_hf(moe_family_layouts: dict) -> Path:
    return Path(moe_family_layouts["hf"]["qwen3_moe"])


def _rel_f(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


LAYOUT_NAMES = ["ep2", "tp2", "tp2etp1", "tp2ep2", "ep2_grouped", "tp2_grouped"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_layout_loss_and_gradients_match_single_rank(layouts: dict, layout: str) -> None:
    assert layout not in layouts["errors"], layouts["errors"][layout]
    assert _rel_f(layouts["loss"][layout], layouts["loss"]["ref"]) <= 1e-5
    assert layouts["grad_keys_equal"][layout]
    assert layouts["grad_err"][layout] <= 1e-5


@pytest.mark.slow
def test_routing_is_deterministic(layouts: dict) -> None:
    assert layouts["deterministic"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2", "tp2ep2"])
def test_training_tracks_single_rank_and_reports_aux_loss(layouts: dict, layout: str) -> None:
    ref, got = layouts["train"]["ref"], layouts["train"][layout]
    assert len(ref) == len(got) == 4
    assert max(_rel_f(a, b) for a, b in zip(got, ref, strict=True)) <= 1e-5
    assert ref[-1] < ref[0]
    aux_ref, aux = layouts["aux"]["ref"], layouts["aux"][layout]
    assert all(a > 0.5 for a in aux_ref)  # ~1 for balanced routing (megatron's normalisation)
    assert max(_rel_f(a, b) for a, b in zip(aux, aux_ref, strict=True)) <= 1e-4


@pytest.mark.slow
def test_ep2_checkpoint_resumes(layouts: dict) -> None:
    resumed, ep2 = layouts["train"]["ep2_resumed"], layouts["train"]["ep2"]
    assert resumed[:2] == [float("-inf")] * 2
    assert resumed[2:] == ep2[2:]  # bit for bit: same routing, same everything


@pytest.mark.slow
@torch.no_grad()
def test_save_hf_at_every_layout_matches_and_loads(layouts: dict) -> None:
    """``train.save_hf`` gathers the experts from every EP/TP rank: the same trained weights as TP=1."""
    exports = {name: Path(p) for name, p in layouts["hf_exports"].items()}
    _, ref = read_hf_folder(exports["ref"])
    for name in ("tp2ep2", "ep2"):
        _, got = read_hf_folder(exports[name])
        assert set(got) == set(ref)
        assert max(_rel(got[k], ref[k]) for k in ref) <= 1e-4
    hf, info = AutoModelForCausalLM.from_pretrained(exports["tp2ep2"], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


@pytest.mark.slow
def test_convert_round_trip_and_ep2_checkpoint_export(layouts: dict, tiny_qwen3_moe_hf: Path, tmp_path) -> None:
    from loong.llm.cli import main

    loong, back = tmp_path / "loong", tmp_path / "back"
    assert main(["convert", str(tiny_qwen3_moe_hf), str(loong)]) == 0
    assert main(["convert", str(loong), str(back)]) == 0
    cfg_a, a = read_hf_folder(tiny_qwen3_moe_hf)
    cfg_b, b = read_hf_folder(back)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert {k: cfg_b[k] for k in ("num_experts", "moe_intermediate_size", "num_experts_per_tok",
                                  "norm_topk_prob", "router_aux_loss_coef")} == \
        {"num_experts": 8, "moe_intermediate_size": 32, "num_experts_per_tok": 2, "norm_topk_prob": True,
         "router_aux_loss_coef": 0.01}
    # a checkpoint saved at EP=2 (experts split over two ranks) converts to a whole HF model
    ep2 = tmp_path / "from_ep2"
    assert main(["convert", layouts["ep2_checkpoint"], str(ep2)]) == 0
    _, c = read_hf_folder(ep2)
    assert set(c) == set(a) and not any(torch.equal(c[k], a[k]) for k in a if ".experts.7.down" in k)


@pytest.mark.slow
def test_dense_sequence_parallel_without_transformer_engine(layouts: dict) -> None:
    """SPRMSNorm: a dense Qwen3 (QK-norm) at TP=2 with sequence parallelism equals TP=1."""
    got = layouts["dense_sp"]
    assert _rel_f(got["loss"][1], got["loss"][0]) <= 1e-5
    assert got["grad_keys_equal"] and got["grad_err"] <= 1e-5
