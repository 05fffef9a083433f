"""Shared fixtures: tiny random Hugging Face checkpoints built in-process (no downloads), a one-rank CPU world
and a builder of Loong models in it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def cpu_world():  # noqa: ANN201
    """``(accelerator, layout)`` of a one-process CPU world, for the module's tests."""
    from loong.core.accelerators import select_accelerator
    from loong.core.engines.megatron.layout import world

    acc = select_accelerator("cpu")
    with world(acc) as layout:
        yield acc, layout


@pytest.fixture(scope="module")
def build_gpt(cpu_world):  # noqa: ANN001, ANN201
    """``build_gpt(model_config)``: the fp32 Loong model of that config in the CPU world, seeded alike each time."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from loong.core.config.schema import ParallelConfig
    from loong.llm.models.build import build_gpt_model, transformer_config

    acc, layout = cpu_world

    def build(cfg):  # noqa: ANN001, ANN202
        model_parallel_cuda_manual_seed(0)
        tc = transformer_config(cfg, ParallelConfig(), torch.float32, {"use_cpu_initialization": True})
        return build_gpt_model(cfg, tc, acc.capabilities(), True, True, layout.pg_collection)

    return build


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


@pytest.fixture(scope="session")
def moe_family_layouts(tmp_path_factory: pytest.TempPathFactory, run_workers) -> dict:  # noqa: ANN001
    """Qwen3-MoE's and DeepSeek-V3's layout checks (``test_moe.py``, ``test_deepseek_v3.py``) from one 2-process
    launch (``workers/moe_family_layouts.py``): ``{"qwen3_moe": results, "deepseek_v3": results, "hf": folders}``."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_deepseek_v3 import build_tiny_deepseek_v3_hf
    from test_moe import build_tiny_moe_hfs

    root = tmp_path_factory.mktemp("moe_family_layouts")
    moe, dense = build_tiny_moe_hfs(root)
    dsv3 = build_tiny_deepseek_v3_hf(root / "tiny-deepseek-v3")
    run_workers(Path(__file__).parent / "workers" / "moe_family_layouts.py", str(moe), str(dense), str(dsv3), str(root))
    return {"qwen3_moe": json.loads((root / "qwen3_moe.json").read_text()),
            "deepseek_v3": json.loads((root / "deepseek_v3.json").read_text()),
            "hf": {"qwen3_moe": str(moe), "deepseek_v3": str(dsv3)}}
