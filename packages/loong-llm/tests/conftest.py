"""Shared fixtures: tiny random Hugging Face checkpoints built in-process (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_llama_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer LlamaForCausalLM with random weights and the packaged tokenizer's vocab size."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
                      tie_word_embeddings=False)
    out = tmp_path_factory.mktemp("hf") / "tiny-llama"
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out
