"""The foundation (loong-llm's megatron GPT as a VLM's language model) against transformers' Qwen VL text models:
multimodal inputs, M-RoPE (chunked and interleaved), DeepStack, packing, TP=2, and the text-side HF mapping.

CPU, fp32, tiny random models built in-process (``foundation_cases.py``), no downloads.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from foundation_cases import CASES, DEEPSTACK, IMAGE_TOKEN, TEXT, batch, build_loong, hf_logits, hf_model, rel  # noqa: E402

from loong.core.config.schema import ParallelConfig  # noqa: E402
from loong.core.errors import LoongError  # noqa: E402
from loong.llm.hf_io import read_hf_folder, write_hf_folder  # noqa: E402
from loong.llm.models.build import transformer_config  # noqa: E402
from loong.vlm.models.foundation import (  # noqa: E402
    build_foundation,
    check_mrope,
    mrope_channel_rows,
)
from loong.vlm.models.text_mapping import (  # noqa: E402
    HUB,
    LEGACY_TEXT_PREFIX,
    TEXT_PREFIX,
    TRANSFORMERS5,
    experts_layout_of,
    hf_text_config,
    select_text,
    text_config_from_hf,
    text_hf_to_native,
    text_native_to_hf,
    text_prefix_of,
)

TOL = 1e-5
WORKER = Path(__file__).parent / "workers" / "foundation_tp.py"


@pytest.fixture(scope="module")
def cpu():
    """``(accelerator, layout)`` of a one-process CPU world for the module."""
    from loong.core.accelerators import select_accelerator
    from loong.core.engines.megatron.layout import world

    acc = select_accelerator("cpu")
    with world(acc) as layout:
        yield acc, layout


@pytest.fixture(scope="module")
def models() -> dict:
    return {case: hf_model(case) for case in CASES}


def _loong(case: str, models: dict, cpu, **kw):  # noqa: ANN001, ANN202
    acc, layout = cpu
    return build_loong(case, models[case], layout, acc.capabilities(), **kw)


# --- parity ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_logits_and_loss_match_transformers(cpu, models, case):
    hf = models[case]
    bt = batch(case, hf)
    loong = _loong(case, models, cpu)
    ref = hf_logits(hf, bt)
    kw = dict(visual_embeds=bt.visual_embeds, visual_mask=bt.visual_mask, deepstack_embeds=bt.deepstack)
    got = loong(bt.input_ids, bt.position_ids, None, **kw)
    assert got.shape == ref.shape and rel(got, ref) <= TOL
    losses = loong(bt.input_ids, bt.position_ids, None, labels=bt.labels, **kw)
    ref_losses = F.cross_entropy(ref.flatten(0, 1), bt.labels.flatten(), reduction="none").view_as(losses)
    assert rel(losses, ref_losses) <= TOL and abs(losses.mean().item() / ref_losses.mean().item() - 1) <= TOL
    # each ingredient shows in the logits: the M-RoPE rows, the visual rows, the DeepStack features
    flat = torch.arange(bt.input_ids.shape[1]).expand_as(bt.input_ids)
    assert rel(loong(bt.input_ids, flat, None, **kw), ref) > 1e-2
    assert rel(loong(bt.input_ids, bt.position_ids, None, **{**kw, "visual_embeds": None}), ref) > 1e-2
    if bt.deepstack:
        assert rel(loong(bt.input_ids, bt.position_ids, None, **{**kw, "deepstack_embeds": None}), ref) > 1e-2


@torch.no_grad()
def test_fused_kernels_take_mrope_and_deepstack(cpu, models):
    """loong-kernels' fused RoPE (and norm, SwiGLU, linear + cross-entropy; reference backend on CPU) take the
    M-RoPE frequencies unchanged."""
    from loong.llm.models.fused import FusedKernels

    hf = models["qwen3_vl"]
    bt = batch("qwen3_vl", hf)
    loong = _loong("qwen3_vl", models, cpu, fused_kernels=FusedKernels.everything("reference"))
    assert any(type(m).__name__ == "FusedRoPESelfAttention" for m in loong.modules())
    kw = dict(visual_embeds=bt.visual_embeds, visual_mask=bt.visual_mask, deepstack_embeds=bt.deepstack)
    ref = hf_logits(hf, bt)
    assert rel(loong(bt.input_ids, bt.position_ids, None, **kw), ref) <= TOL
    losses = loong(bt.input_ids, bt.position_ids, None, labels=bt.labels, **kw)
    ref_losses = F.cross_entropy(ref.flatten(0, 1), bt.labels.flatten(), reduction="none").view_as(losses)
    assert rel(losses, ref_losses) <= TOL


@torch.no_grad()
def test_text_only_path_is_the_llm_path(cpu, models):
    """[b, s] position ids and no visual inputs: bit-identical to loong-llm's LoongGPTModel on the same weights, and
    M-RoPE ids whose three rows are equal give the same logits as 1-D RoPE (what transformers does with text)."""
    from loong.core.engines.megatron.state import gather_full_state, load_full_state
    from loong.llm.models.build import build_gpt_model

    acc, layout = cpu
    hf = models["qwen3_vl"]
    bt = batch("qwen3_vl", hf)
    loong = _loong("qwen3_vl", models, cpu)
    text = text_config_from_hf(hf.config.to_dict())
    tc = transformer_config(text.model, ParallelConfig(), torch.float32, {"use_cpu_initialization": True})
    llm = build_gpt_model(text.model, tc, acc.capabilities(), True, True, layout.pg_collection).eval()
    load_full_state([llm], gather_full_state([loong]))
    pos = torch.arange(bt.input_ids.shape[1]).expand_as(bt.input_ids)
    out = loong(bt.input_ids, pos, None)
    assert torch.equal(out, llm(bt.input_ids, pos, None))
    assert rel(loong(bt.input_ids, pos.expand(3, -1, -1), None), out) <= TOL
    assert rel(out, hf.lm_head(hf.model.language_model(input_ids=bt.input_ids).last_hidden_state)) <= TOL


@pytest.mark.parametrize("case", ["qwen2_5_vl", "qwen3_vl"])
@torch.no_grad()
def test_packed_samples_equal_each_alone(cpu, models, case):
    """Two samples in one row with document ids and M-RoPE ids restarting per sample (visual rows and DeepStack
    features in row order) give each sample's logits run alone."""
    hf = models[case]
    bt = batch(case, hf)
    loong = _loong(case, models, cpu)
    s = bt.input_ids.shape[1]
    split = int(bt.visual_mask[0].sum())
    alone = []
    for i, rows in ((0, slice(0, split)), (1, slice(split, None))):
        alone.append(loong(bt.input_ids[i:i + 1], bt.position_ids[:, i:i + 1], None,
                           visual_embeds=bt.visual_embeds[rows], visual_mask=bt.visual_mask[i:i + 1],
                           deepstack_embeds=[d[rows] for d in bt.deepstack]))
    docs = torch.cat([torch.zeros(s, dtype=torch.long), torch.ones(s, dtype=torch.long)])[None]
    packed = loong(bt.input_ids.reshape(1, -1), bt.position_ids.reshape(3, 1, -1), docs,
                   visual_embeds=bt.visual_embeds, visual_mask=bt.visual_mask.reshape(1, -1),
                   deepstack_embeds=bt.deepstack)
    assert rel(packed, torch.cat(alone, dim=1)) <= TOL


@pytest.mark.parametrize("case", ["qwen3_vl"])
def test_gradients_reach_visual_rows_and_deepstack(cpu, models, case):
    """The loss's gradient reaches the visual rows and every DeepStack tensor, and the word embeddings get none at
    the replaced placeholder positions (as transformers' masked_scatter)."""
    hf = models[case]
    bt = batch(case, hf)
    loong = _loong(case, models, cpu)
    vis = bt.visual_embeds.clone().requires_grad_()
    ds = [d.clone().requires_grad_() for d in bt.deepstack]
    loong(bt.input_ids, bt.position_ids, None, labels=bt.labels, visual_embeds=vis, visual_mask=bt.visual_mask,
          deepstack_embeds=ds).mean().backward()
    # transformers' gradients of the same loss w.r.t. the same inputs
    text = hf.model.language_model
    ref_vis = bt.visual_embeds.clone().requires_grad_()
    ref_ds = [d.clone().requires_grad_() for d in bt.deepstack]
    embeds = text.embed_tokens(bt.input_ids).masked_scatter(bt.visual_mask[..., None], ref_vis)
    out = text(inputs_embeds=embeds, position_ids=bt.position_ids, visual_pos_masks=bt.visual_mask,
               deepstack_visual_embeds=ref_ds)
    logits = hf.lm_head(out.last_hidden_state)
    F.cross_entropy(logits.flatten(0, 1), bt.labels.flatten()).backward()
    assert rel(vis.grad, ref_vis.grad) <= TOL
    for got, ref in zip(ds, ref_ds, strict=True):
        assert rel(got.grad, ref.grad) <= TOL
    emb, ref_emb = loong.embedding.word_embeddings.weight.grad, text.embed_tokens.weight.grad
    assert rel(emb, ref_emb) <= TOL
    assert set(bt.input_ids[bt.visual_mask].tolist()) == {IMAGE_TOKEN}
    assert emb[IMAGE_TOKEN].abs().max() == 0 and emb[bt.input_ids[0, 0]].abs().max() > 0
    hf.zero_grad()


# --- M-RoPE layouts -------------------------------------------------------------------------------------
def test_mrope_channel_rows_follow_transformers():
    # Qwen2.5-VL: chunks of 16, 24, 24 frequencies read t, h, w
    assert mrope_channel_rows([16, 24, 24], False) == [0] * 16 + [1] * 24 + [2] * 24
    # Qwen3-VL: h at 1, 4, ... (20 of them), w at 2, 5, ... (20), t elsewhere (24)
    rows = mrope_channel_rows([24, 20, 20], True)
    assert rows[:6] == [0, 1, 2, 0, 1, 2] and rows[60:] == [0, 0, 0, 0]
    assert [rows.count(r) for r in (0, 1, 2)] == [24, 20, 20]
    with pytest.raises(LoongError, match="sums to 8 rotary frequencies.*have 16"):
        check_mrope([4, 2, 2], False, kv_channels=32)
    with pytest.raises(LoongError, match="three positive"):
        check_mrope([8, 8], False, kv_channels=32)
    with pytest.raises(LoongError, match="mrope_interleaved=true needs"):
        check_mrope(None, True, kv_channels=32)


# --- refusals --------------------------------------------------------------------------------------------
def test_bad_inputs_and_layouts_are_refused(cpu, models):
    acc, layout = cpu
    hf = models["qwen3_vl"]
    bt = batch("qwen3_vl", hf)
    loong = _loong("qwen3_vl", models, cpu)
    kw = dict(visual_embeds=bt.visual_embeds, visual_mask=bt.visual_mask, deepstack_embeds=bt.deepstack)
    with torch.no_grad():
        with pytest.raises(LoongError, match="visual_embeds has shape .*placeholder tokens"):
            loong(bt.input_ids, bt.position_ids, None, **{**kw, "visual_embeds": bt.visual_embeds[1:]})
        with pytest.raises(LoongError, match="3 DeepStack feature tensors .*deepstack_layers=2"):
            loong(bt.input_ids, bt.position_ids, None, **{**kw, "deepstack_embeds": [*bt.deepstack, bt.deepstack[0]]})
        with pytest.raises(LoongError, match="need visual_mask"):
            loong(bt.input_ids, bt.position_ids, None, **{**kw, "visual_mask": None})
        with pytest.raises(LoongError, match="bool tensor shaped like input_ids"):
            loong(bt.input_ids, bt.position_ids, None, **{**kw, "visual_mask": bt.visual_mask.int()})
        with pytest.raises(LoongError, match="expected \\[b, s\\] or \\[3, b, s\\]"):
            loong(bt.input_ids, bt.position_ids[:2], None)
    text = text_config_from_hf(hf.config.to_dict())
    caps = acc.capabilities()

    def build(model, parallel=ParallelConfig(), pre=True, **kw):  # noqa: ANN001, ANN003, ANN202, B008
        tc = transformer_config(model, parallel, torch.float32, {"use_cpu_initialization": True})
        return build_foundation(model, tc, caps, pre, True, layout.pg_collection, None, **kw)

    plain = build(text.model).eval()  # 1-D RoPE only
    with pytest.raises(LoongError, match="without mrope_section"), torch.no_grad():
        plain(bt.input_ids, bt.position_ids, None)
    with pytest.raises(LoongError, match="first pipeline stage holds 1 .*foundation.parallel.pp=3"):
        build(text.model, ParallelConfig(pp=3), mrope_section=[4, 2, 2], deepstack_layers=2)
    with pytest.raises(LoongError, match="recompute=full"):
        build(dataclasses.replace(text.model, recompute="full"), deepstack_layers=1)
    with pytest.raises(LoongError, match="foundation has 3"):
        build(text.model, deepstack_layers=4)
    later = build(text.model, pre=False, mrope_section=[4, 2, 2], deepstack_layers=2)
    with pytest.raises(LoongError, match="chunk with the embedding"), torch.no_grad():
        later(bt.input_ids, bt.position_ids, None, **kw)


# --- TP = 2 -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One 2-process gloo launch (``workers/foundation_tp.py``): TP=1, TP=2 and TP=2 with sequence parallelism
    (dense), TP=1 and TP=2 (MoE, sequence-parallel as loong-llm runs MoE at TP > 1), CP=2 against TP=1 (causal and
    packed rows)."""
    import os
    import subprocess

    out = tmp_path_factory.mktemp("foundation_tp") / "result.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "LOONG_SINGLE_PROCESS")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(WORKER), str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("run", ["qwen3_vl/tp2", "qwen3_vl/tp2_sp", "qwen3_vl_moe/tp2"])
def test_tp2_equals_tp1_for_scatter_and_deepstack(tp_results, run):
    case = run.split("/")[0]
    ref, got = tp_results[f"{case}/tp1"], tp_results[run]
    assert got["sequence_parallel"] == (run != "qwen3_vl/tp2") and got["tp"] == 2
    for key in ("losses", "logits", "visual_grad", *(f"deepstack_grad_{i}" for i in range(DEEPSTACK)),
                "embedding_grad"):
        a, b = torch.tensor(got[key]), torch.tensor(ref[key])
        assert a.shape == b.shape and rel(a, b) <= TOL, key
    assert torch.tensor(ref["visual_grad"]).abs().max() > 0


@pytest.mark.slow
@pytest.mark.parametrize(("run", "ref"), [("qwen3_vl/cp2", "qwen3_vl/tp1"),
                                          ("qwen3_vl/cp2_packed", "qwen3_vl/tp1_packed"),
                                          ("qwen2_5_vl/cp2_packed", "qwen2_5_vl/tp1_packed")])
def test_cp2_equals_one_rank_for_scatter_deepstack_and_packed_documents(tp_results, run, ref):
    """Context parallelism over multimodal rows: each rank's zigzag chunks take the visual rows that fall in them;
    with document ids, the all-gathered keys are masked to each document (an implementation apart from the
    one-rank varlen path it is compared with)."""
    got, want = tp_results[run], tp_results[ref]
    keys = ["losses", "logits", "visual_grad", "embedding_grad"]
    keys += [k for k in want if k.startswith("deepstack_grad_")]
    for key in keys:
        a, b = torch.tensor(got[key]), torch.tensor(want[key])
        assert a.shape == b.shape and rel(a, b) <= TOL, key
    if ref.endswith("_packed"):  # the documents change the result: the mask is really applied
        causal = tp_results[ref.replace("_packed", "")] if ref.startswith("qwen3_vl") else None
        if causal is not None:
            assert rel(torch.tensor(want["logits"]), torch.tensor(causal["logits"])) > 1e-3
        padding = torch.tensor(want["losses"])[1, 26:]
        assert torch.isfinite(padding).all()


# --- HF mapping ---------------------------------------------------------------------------------------------
def _saved_state(hf, folder: Path) -> dict:
    hf.save_pretrained(folder)
    return read_hf_folder(folder)[1]


@pytest.mark.parametrize("case", CASES)
def test_hf_loong_hf_bit_exact(models, case, tmp_path):
    hf = models[case]
    text = text_config_from_hf(hf.config.to_dict())
    files = _saved_state(hf, tmp_path / "hf")
    prefix = text_prefix_of(files)
    # transformers 5 writes Qwen2.5-VL in the Qwen2-VL layout (text under "model.", vision under "visual.")
    assert prefix == (LEGACY_TEXT_PREFIX if case == "qwen2_5_vl" else TEXT_PREFIX)
    memory = select_text(hf.state_dict())
    native = text_hf_to_native(memory, text.model)
    states = {"files": (files, prefix)}
    if text.model.is_moe:  # the published checkpoints' expert layout: [E, D, 2F] and [E, F, D]
        assert experts_layout_of(memory, text.model) == TRANSFORMERS5
        hub = {k: (v.transpose(1, 2) if ".mlp.experts." in k else v) for k, v in select_text(files).items()}
        assert experts_layout_of(hub, text.model, prefix) == HUB
        states["hub"] = (hub, prefix)
    for name, (state, pre) in states.items():
        part = select_text(state, pre)
        assert not set(part) & {k for k in state if "visual" in k}
        again = text_hf_to_native(part, text.model, pre)
        assert set(again) == set(native) and all(torch.equal(again[k], native[k]) for k in native), name
        layout = experts_layout_of(part, text.model, pre) if text.model.is_moe else HUB
        for dtype in (torch.float32, torch.bfloat16):
            typed = {k: v.to(dtype) for k, v in part.items()}
            back = text_native_to_hf(text_hf_to_native(typed, text.model, pre), text.model, pre, layout)
            assert set(back) == set(typed), name
            for key, t in typed.items():
                assert back[key].dtype == dtype and torch.equal(back[key], t), (name, key)


@pytest.mark.parametrize("case", CASES)
def test_export_loads_in_transformers(models, case, tmp_path):
    """The text tensors written from Loong's native ones (experts in the published layout) and the vision tensors
    load with from_pretrained into the same model."""
    from transformers import AutoModelForImageTextToText

    hf = models[case]
    text = text_config_from_hf(hf.config.to_dict())
    files = _saved_state(hf, tmp_path / "hf")
    prefix = text_prefix_of(files)
    state = {k: v for k, v in files.items() if k not in select_text(files, prefix)}
    state.update(text_native_to_hf(text_hf_to_native(select_text(files, prefix), text.model, prefix), text.model,
                                   prefix, HUB))
    if text.model.is_moe:
        assert experts_layout_of(state, text.model, prefix) == HUB
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    write_hf_folder(tmp_path / "out", config, {k: v.contiguous() for k, v in state.items()})
    back, info = AutoModelForImageTextToText.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ref = hf.state_dict()
    got = back.state_dict()
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)


def test_mapping_errors(models):
    hf = models["qwen3_vl_moe"]
    text = text_config_from_hf(hf.config.to_dict())
    part = select_text(hf.state_dict())
    with pytest.raises(LoongError, match="not the text model's"):
        text_hf_to_native(hf.state_dict(), text.model)
    key = TEXT_PREFIX + "layers.1.mlp.experts.down_proj"
    with pytest.raises(LoongError, match=f"{key} has shape \\(4, 64, 23\\)"):
        text_hf_to_native({**part, key: part[key][..., :23]}, text.model)
    with pytest.raises(LoongError, match="no tensor model.norm.weight .*under 'model.language_model.'"):
        text_hf_to_native({k: v for k, v in part.items() if not k.endswith("language_model.norm.weight")},
                          text.model)
    with pytest.raises(LoongError, match="no text-model tensors"):
        text_prefix_of(["visual.blocks.0.attn.qkv.weight"])


# --- config -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_text_config_round_trip(models, case):
    from transformers import AutoConfig

    hf_cfg = models[case].config
    text = text_config_from_hf(hf_cfg.to_dict())
    assert text.mrope_section == hf_cfg.text_config.rope_parameters["mrope_section"]
    assert text.mrope_interleaved == (case != "qwen2_5_vl")
    m = text.model
    assert (m.num_layers, m.hidden_size, m.kv_channels, m.vocab_size) == (3, 64, 16, TEXT["vocab_size"])
    assert m.family == {"qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe"}[case]
    if m.is_moe:
        assert (m.num_experts, m.moe_router_topk, m.expert_ffn_hidden_size, m.norm_topk_prob) == (4, 2, 24, True)
    written = {**hf_cfg.to_dict(), "text_config": hf_text_config(text, "float32")}
    reread = AutoConfig.for_model(**{k: v for k, v in written.items() if k != "model_type"},
                                  model_type=hf_cfg.model_type)
    assert text_config_from_hf(reread.to_dict()) == text
    assert reread.text_config.rope_parameters["mrope_section"] == text.mrope_section


def test_qwen2_vl_era_flat_config():
    """Qwen2.5-VL's published config.json: text fields at the top level, rope_scaling of type "mrope"."""
    flat = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
            "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
            "num_key_value_heads": 2, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "max_position_embeddings": 128000, "tie_word_embeddings": True,
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vision_config": {"depth": 32}}
    text = text_config_from_hf(flat)
    assert text.mrope_section == [16, 24, 24] and not text.mrope_interleaved
    assert text.model.rope_theta == 1e6 and text.model.tie_word_embeddings and text.model.kv_channels == 128
    with pytest.raises(LoongError, match="LlavaForConditionalGeneration checkpoint"):
        text_config_from_hf({"architectures": ["LlavaForConditionalGeneration"]})
