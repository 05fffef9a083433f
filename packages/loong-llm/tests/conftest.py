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


def _run_workers(worker: Path, *args: str, nproc: int = 2, timeout: int = 600) -> None:
    """Run a test worker script in ``nproc`` gloo processes through torch.distributed.run."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "LOONG_SINGLE_PROCESS")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
         str(worker), *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="session")
def run_workers():  # noqa: ANN201
    """``run_workers(script, *args)``: a test worker in 2 gloo processes through torch.distributed.run."""
    return _run_workers
