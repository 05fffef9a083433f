"""Hugging Face <-> Loong parity for every dense family (CPU, fp32, tiny random models, no downloads)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config, Qwen3Config

from loong.core.accelerators import select_accelerator
from loong.core.config.schema import ParallelConfig
from loong.core.engines.megatron.layout import init_distributed, shutdown_distributed
from loong.core.engines.megatron.state import gather_full_state, load_full_state
from loong.core.errors import LoongError
from loong.llm.hf_io import INDEX, read_hf_folder, write_hf_folder
from loong.llm.models.build import build_gpt_model, transformer_config
from loong.llm.models.hf_mapping import family_for_hf_config, hf_to_native, native_to_hf

TOL = 1e-5
SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5,
)  # fmt: skip
LLAMA31_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}  # fmt: skip
CASES = {
    "llama": lambda: LlamaConfig(**SHAPE),
    "llama3.1-rope": lambda: LlamaConfig(**SHAPE, rope_parameters=dict(LLAMA31_ROPE)),
    "llama-tied": lambda: LlamaConfig(**SHAPE, tie_word_embeddings=True),
    "qwen2-bias": lambda: Qwen2Config(**SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen3-qknorm": lambda: Qwen3Config(**SHAPE, head_dim=32),  # head_dim != 64 / 4
}


@pytest.fixture(scope="module")
def cpu():
    """A world of one on the CPU accelerator, for the whole module."""
    acc = select_accelerator("cpu")
    ctx = acc.activate()
    ctx.__enter__()
    try:
        layout = init_distributed(acc, ParallelConfig())
        yield acc, layout
    finally:
        shutdown_distributed()
        ctx.__exit__(None, None, None)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (2, 96), generator=g)
    return tokens, torch.arange(96).unsqueeze(0).expand(2, -1)


@torch.no_grad()
def _randomize(tensors, seed: int) -> None:
    """Random values everywhere, norms around 1 (so a swapped norm or mixed-up head shows)."""
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors:
        noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
        t.copy_(1.0 + 0.2 * noise if "norm" in name else 0.05 * noise)


def _hf_model(case: str, tmp_path):
    """A random tiny HF model for ``case``, saved by transformers, and its folder."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CASES[case](), dtype=torch.float32, attn_implementation="eager")
    _randomize(model.named_parameters(), seed=2)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    return model.eval(), folder


def _loong_model(cpu, model_cfg):
    acc, layout = cpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)
    tc = transformer_config(model_cfg, ParallelConfig(), torch.float32, {"use_cpu_initialization": True})
    return build_gpt_model(model_cfg, tc, acc.capabilities(), True, True, layout.pg_collection).eval()


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_hf_to_loong_logits(cpu, case, tmp_path):
    hf, folder = _hf_model(case, tmp_path)
    hf_cfg, state = read_hf_folder(folder)
    model_cfg = family_for_hf_config(hf_cfg).config_from_hf(hf_cfg)
    loong = _loong_model(cpu, model_cfg)
    load_full_state([loong], hf_to_native(state, model_cfg))
    tokens, pos = _inputs(model_cfg.vocab_size)
    assert _rel(loong(tokens, pos, None), hf(tokens).logits) <= TOL


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_loong_to_hf_logits(cpu, case, tmp_path):
    _, folder = _hf_model(case, tmp_path)
    hf_cfg, _ = read_hf_folder(folder)
    family = family_for_hf_config(hf_cfg)
    model_cfg = family.config_from_hf(hf_cfg)
    loong = _loong_model(cpu, model_cfg)  # megatron's own init, then random norms: independent of HF
    full = gather_full_state([loong])
    _randomize(sorted(full.items()), seed=3)
    load_full_state([loong], full)

    out = write_hf_folder(
        tmp_path / "export", family.hf_config_dict(model_cfg, "float32"),
        native_to_hf(gather_full_state([loong]), model_cfg), max_shard_bytes=64 * 1024,
    )  # fmt: skip
    assert (out / INDEX).is_file() and (out / "generation_config.json").is_file()
    hf, info = AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert hf.dtype == torch.float32
    tokens, pos = _inputs(model_cfg.vocab_size)
    assert _rel(hf.eval()(tokens).logits, loong(tokens, pos, None)) <= TOL
    # transformers reads the written config back to the same model config
    reread = AutoConfig.from_pretrained(out).to_dict()
    assert family.config_from_hf(reread) == model_cfg
    assert json.loads((out / "config.json").read_text())["architectures"] == list(hf_cfg["architectures"])


@pytest.mark.parametrize("case", list(CASES))
def test_hf_loong_hf_bit_exact(case, tmp_path):
    _, folder = _hf_model(case, tmp_path)
    hf_cfg, state = read_hf_folder(folder)
    model_cfg = family_for_hf_config(hf_cfg).config_from_hf(hf_cfg)
    for dtype in (torch.float32, torch.bfloat16):
        typed = {k: v.to(dtype) for k, v in state.items()}
        back = native_to_hf(hf_to_native(typed, model_cfg), model_cfg)
        assert set(back) == set(typed)
        for key, t in typed.items():
            assert back[key].dtype == dtype and torch.equal(back[key], t), key
    # and through a written folder
    write_hf_folder(tmp_path / "again", hf_cfg, native_to_hf(hf_to_native(state, model_cfg), model_cfg))
    _, again = read_hf_folder(tmp_path / "again")
    assert set(again) == set(state) and all(torch.equal(again[k], state[k]) for k in state)


def test_legacy_rope_config_form():
    """A transformers 4.x config.json (rope_theta + rope_scaling) reads like the 5.x form."""
    new = LlamaConfig(**SHAPE, rope_parameters=dict(LLAMA31_ROPE)).to_dict()
    legacy = {k: v for k, v in new.items() if k != "rope_parameters"}
    legacy["rope_theta"] = 500000.0
    legacy["rope_scaling"] = {k: v for k, v in LLAMA31_ROPE.items() if k != "rope_theta"}
    fam = family_for_hf_config(legacy)
    assert fam.config_from_hf(legacy) == fam.config_from_hf(new)
    assert fam.config_from_hf(legacy).rope_scaling.original_max_position_embeddings == 64


def test_rejects_other_architectures():
    gpt2 = {**GPT2Config().to_dict(), "architectures": ["GPT2LMHeadModel"]}
    with pytest.raises(LoongError) as err:
        family_for_hf_config(gpt2, source="/ckpt/gpt2")
    msg = str(err.value)
    assert "\n" not in msg and "GPT2LMHeadModel" in msg and "Qwen3ForCausalLM" in msg
    with pytest.raises(LoongError, match="model_type='gpt2'"):
        family_for_hf_config({"model_type": "gpt2"})
    with pytest.raises(LoongError, match="rope type 'yarn'"):
        family_for_hf_config({"model_type": "qwen2"}).config_from_hf(
            {**Qwen2Config(**SHAPE).to_dict(), "rope_scaling": {"type": "yarn", "factor": 4.0}}
        )


def test_mapping_and_folder_errors(tmp_path):
    _, folder = _hf_model("llama", tmp_path)
    hf_cfg, state = read_hf_folder(folder)
    model_cfg = family_for_hf_config(hf_cfg).config_from_hf(hf_cfg)
    with pytest.raises(LoongError, match="does not have"):
        hf_to_native({**state, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}, model_cfg)
    with pytest.raises(LoongError, match="no tensor model.norm.weight"):
        hf_to_native({k: v for k, v in state.items() if k != "model.norm.weight"}, model_cfg)
    with pytest.raises(LoongError, match="no such"):
        read_hf_folder(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoongError, match="no config.json"):
        read_hf_folder(tmp_path / "empty")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text("{}")
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(LoongError, match="safetensors only"):
        read_hf_folder(tmp_path / "bin")
