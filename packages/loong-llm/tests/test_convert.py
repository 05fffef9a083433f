"""``loong-llm convert``: HF → Loong → HF is bit-exact, and a converted checkpoint trains like ``init_from_hf``.

One tiny random LLaMA (the ``tiny_llama_hf`` fixture) goes through both conversions and two 3-step runs:
``train.resume=<converted>`` and ``model.init_from_hf=<hf folder>`` must start from the same weights
(the HF model's own loss on the first batch) and so log the same losses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from loong.llm.cli import main

pytestmark = pytest.mark.slow

TRAIN = ["train.steps=3", "train.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=2",
         "train.eval_interval=0", "train.eval_iters=0", "train.progress=false"]


def _train_losses(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["train_loss"]) for r in records if "train_loss" in r]


@pytest.fixture(scope="module")
def converted(tiny_llama_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """HF folder → Loong checkpoint → HF folder, through the CLI."""
    root = tmp_path_factory.mktemp("convert")
    loong, back = root / "loong", root / "hf_again"
    assert main(["convert", str(tiny_llama_hf), str(loong)]) == 0
    assert main(["convert", str(loong), str(back)]) == 0
    return {"hf": tiny_llama_hf, "loong": loong, "back": back, "root": root}


@pytest.fixture(scope="module")
def runs(converted: dict[str, Path]) -> dict[str, Path]:
    """Two 3-step runs from the same weights: resumed from the converted checkpoint, and init_from_hf."""
    out = converted["root"] / "runs"
    assert main(["train", *TRAIN, f"output_dir={out}", "run_name=resumed",
                 f"train.resume={converted['loong'] / 'checkpoints'}"]) == 0
    assert main(["train", *TRAIN, f"output_dir={out}", "run_name=init_hf",
                 f"model.init_from_hf={converted['hf']}"]) == 0
    return {"resumed": out / "resumed", "init_hf": out / "init_hf"}


def test_hf_to_loong_writes_weights_only_checkpoint(converted: dict[str, Path]) -> None:
    from loong.core.checkpoint import read_config, read_state, resolve_checkpoint

    ckpts = converted["loong"] / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000000"
    step_dir = resolve_checkpoint(converted["loong"])
    assert step_dir == ckpts / "step_00000000"
    state = read_state(step_dir)
    assert state["step"] == 0 and state["weights_only"] is True
    model = read_config(step_dir)["model"]
    assert (model["family"], model["num_layers"], model["hidden_size"], model["ffn_hidden_size"]) == (
        "llama", 4, 64, 128)
    assert (model["num_attention_heads"], model["num_query_groups"], model["vocab_size"]) == (4, 2, 512)
    assert model["max_position_embeddings"] == 256 and model["tie_word_embeddings"] is False


def test_round_trip_is_bit_exact(converted: dict[str, Path]) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    orig = load_file(converted["hf"] / "model.safetensors")
    again = load_file(converted["back"] / "model.safetensors")
    assert set(again) == set(orig)
    for key, tensor in orig.items():
        assert again[key].dtype == tensor.dtype and torch.equal(again[key], tensor), key

    a, b = AutoConfig.from_pretrained(converted["hf"]), AutoConfig.from_pretrained(converted["back"])
    assert b.architectures == ["LlamaForCausalLM"] and b.model_type == "llama"
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                  "tie_word_embeddings", "hidden_act"):
        assert getattr(b, field) == getattr(a, field), field

    # and the whole model behaves identically (the config translation matters too: rope, eps, ...)
    tokens = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        la = AutoModelForCausalLM.from_pretrained(converted["hf"], attn_implementation="eager")(tokens).logits
        lb = AutoModelForCausalLM.from_pretrained(converted["back"], attn_implementation="eager")(tokens).logits
    assert torch.equal(la, lb)


def test_resume_from_converted_takes_model_from_checkpoint(runs: dict[str, Path]) -> None:
    from loong.core.checkpoint import read_config, read_state, resolve_checkpoint

    step_dir = resolve_checkpoint(runs["resumed"])
    model = read_config(step_dir)["model"]
    # no model override was given: the shape is the checkpoint's, not the tiny default (4 x 128)
    assert (model["num_layers"], model["hidden_size"], model["num_query_groups"]) == (4, 64, 2)
    assert read_state(step_dir)["step"] == 3  # a weights-only checkpoint starts a fresh run at step 0
    assert [s for s, _ in _train_losses(runs["resumed"])] == [1, 2, 3]


def test_converted_and_init_from_hf_train_identically(runs: dict[str, Path]) -> None:
    resumed, init_hf = _train_losses(runs["resumed"]), _train_losses(runs["init_hf"])
    assert [s for s, _ in resumed] == [s for s, _ in init_hf] == [1, 2, 3]
    for (_, a), (_, b) in zip(resumed, init_hf, strict=True):
        assert abs(a - b) <= 1e-6, (resumed, init_hf)


def test_first_loss_is_the_hf_models_loss(runs: dict[str, Path], converted: dict[str, Path]) -> None:
    """Both runs really start from the HF weights: their first loss is what HF computes on batch 0."""
    from transformers import AutoModelForCausalLM

    from loong.llm.data.text import GlobalBatchSampler, make_microbatch, split_stream, tokenize_corpus
    from loong.llm.data.tokenizer import build_packaged_tokenizer, packaged_corpus_path

    cfg = yaml.safe_load((runs["init_hf"] / "checkpoints" / "step_00000003" / "config.yaml").read_text())
    t = cfg["train"]
    tokens = tokenize_corpus(packaged_corpus_path(), build_packaged_tokenizer())
    train, _ = split_stream(tokens, t["seq_length"], cfg["data"]["valid_fraction"], "corpus")
    sampler = GlobalBatchSampler(len(train), t["seed"])
    batch = make_microbatch([train[sampler.index(g)] for g in range(t["global_batch_size"])])
    hf = AutoModelForCausalLM.from_pretrained(converted["hf"], attn_implementation="eager").eval()
    with torch.no_grad():
        logits = hf(batch["tokens"]).logits
    hf_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten()).item()
    first = _train_losses(runs["init_hf"])[0][1]
    assert abs(first - hf_loss) <= 1e-4, (first, hf_loss)
    assert abs(_train_losses(runs["resumed"])[0][1] - hf_loss) <= 1e-4
