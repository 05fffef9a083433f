"""Qwen3-MoE optimiser state resumed at another EP/TP layout (``workers/moe_reshard.py``: one 2-process and
one 1-process gloo launch).

At EP > 1 megatron-core builds a ChainedOptimizer (dense + expert parameters) whose sharded keys were
``chained_<i>.``-prefixed, unlike the EP = 1 optimiser's; Loong writes the plain optimiser's state in one
layout-independent form (``loong.core.engines.megatron.optimizer_state``). Each case resumes a checkpoint saved after 2 of
4 Adam steps: the Adam moments right after the restore, gathered to whole tensors, equal the ones written;
the step count is the saved one; the losses of steps 3 and 4 are those of the uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

WORKER = Path(__file__).parent / "workers" / "moe_reshard.py"

#: every resume at a layout other than the one that saved, with its uninterrupted reference
CASES = ["ep2_to_ep1", "ep1_to_ep2", "ep2_to_tp2", "ep1_to_tp2ep2", "ep2_to_ep1_one_rank",
         "legacy_ep2_to_ep1", "dense_legacy_tp2_to_tp1"]


def _tiny_qwen3_moe() -> Qwen3MoeConfig:
    """test_moe.py's 2-layer, 8-expert, top-2 model at the packaged tokenizer's vocab size."""
    return Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512, rms_norm_eps=1e-6,
        router_aux_loss_coef=0.01,
    )  # fmt: skip


@pytest.fixture(scope="module")
def resharded(tmp_path_factory: pytest.TempPathFactory, tiny_llama_hf: Path, run_workers) -> dict:  # noqa: ANN001
    root = tmp_path_factory.mktemp("moe_reshard")
    torch.manual_seed(0)
    hf = root / "tiny-qwen3-moe"
    AutoModelForCausalLM.from_config(_tiny_qwen3_moe(), dtype=torch.float32).save_pretrained(hf)
    runs = root / "runs"
    runs.mkdir()
    run_workers(WORKER, str(hf), str(tiny_llama_hf), str(runs), str(root / "two.json"))
    run_workers(WORKER, str(hf), str(tiny_llama_hf), str(runs), str(root / "one.json"), nproc=1)
    return {**json.loads((root / "two.json").read_text()), **json.loads((root / "one.json").read_text())}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_optimizer_state_resumes_at_another_layout(resharded: dict, case: str) -> None:
    got = resharded[case]
    # the Adam moments as written, wherever they now live (dense/expert optimiser, TP/EP slices)
    assert got["moment_keys_equal"]
    assert got["moment_max_diff"] == 0.0 and got["moment_scale"] > 0
    assert got["steps"] == got["ref_steps"] == [2.0]
    losses, ref = got["losses"], got["ref_losses"]
    assert losses[:2] == [float("-inf")] * 2
    assert _rel(losses[2], ref[2]) <= 1e-6  # the first loss after the resume: same weights
    assert _rel(losses[3], ref[3]) <= 1e-6  # the first loss after an Adam step from the loaded state


@pytest.mark.slow
def test_ep_change_changes_the_optimizer_split(resharded: dict) -> None:
    """The cases do cross megatron's split: one optimiser at EP=1, dense + expert optimisers at EP=2."""
    assert (resharded["ep2_to_ep1"]["ref_parts"], resharded["ep2_to_ep1"]["parts"]) == (2, 1)
    assert (resharded["ep1_to_ep2"]["ref_parts"], resharded["ep1_to_ep2"]["parts"]) == (1, 2)
    unint = resharded["uninterrupted"]
    assert unint["ep2"] == unint["legacy_ep2"]  # the old-format checkpoint run is the same training


@pytest.mark.slow
def test_distributed_optimizer_resumes_exactly_and_refuses_another_ep(resharded: dict) -> None:
    got = resharded["dist_ep2_to_ep2"]
    assert got["losses"][2:] == got["ref_losses"][2:]  # bit for bit: Adam's step count survives too
    error = resharded["dist_ep2_to_ep1_error"]
    assert error is not None and "ep=2" in error and "train.distributed_optimizer=false" in error
