"""Data-parallel balancing of SFT conversations (``data.balance``): the same conversations, the same
loss and gradients as without balancing; resume continues the balanced (and fitted) run exactly.

One 2-process gloo launch (``workers/sft_balance.py``) produces every figure compared here.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from loong.core.errors import LoongError

WORKER = Path(__file__).parent / "workers" / "sft_balance.py"
WORDS = ("the model reads tokens and learns to answer questions about data with care while "
         "ranks share work evenly across every step").split()


def skewed_chat(path: Path, n: int = 64, seed: int = 0) -> Path:
    """Conversations whose answers range from two words to past the sequence length (skewed short)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = 2 + int(60 * rng.random() ** 3)
        answer = " ".join(rng.choice(WORDS) for _ in range(words))
        rows.append({"messages": [{"role": "user", "content": f"question {i}"},
                                  {"role": "assistant", "content": answer}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def result(tiny_llama_hf: Path, tmp_path_factory: pytest.TempPathFactory, run_workers) -> dict:  # noqa: ANN001
    out = tmp_path_factory.mktemp("balance")
    chat = skewed_chat(out / "chat.jsonl")
    run_workers(WORKER, str(tiny_llama_hf), str(chat), str(out))
    return torch.load(out / "result.pt", weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("packing", ["true", "false"])
def test_balanced_step_uses_same_conversations_loss_and_grads(result: dict, packing: str) -> None:
    plain, balanced = result[f"packing={packing},balance=false"], result[f"packing={packing},balance=true"]
    # Every conversation of the global batch exactly once, on some rank ...
    assert sorted(sum(plain["docs"], [])) == sorted(sum(balanced["docs"], []))
    assert len(set(sum(balanced["docs"], []))) == len(sum(balanced["docs"], []))
    # ... but not where it was without balancing, and the predicted balance improved.
    assert plain["docs"] != balanced["docs"]
    m = balanced["metrics"]
    assert m["balance_after"] < m["balance_before"], m
    assert m["balance_after"] <= 1.05, m
    # The same per-token mean over the same tokens: only summation order differs.
    assert balanced["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert sorted(balanced["grads"]) == sorted(plain["grads"])
    for k, g in plain["grads"].items():
        err = float((balanced["grads"][k] - g).abs().max() / g.abs().max().clamp(min=1e-12))
        assert err < 1e-5, (k, err)


@pytest.mark.slow
def test_fitted_balance_resumes_exactly(result: dict) -> None:
    a, b, c, *_ = result["fitted"]
    assert min(a, b, c) >= 0 and max(a, b, c) > 0
    records = [json.loads(line) for line in result["metrics"].splitlines()]
    train = [r for r in records if "train_loss" in r]
    assert all("balance_before" in r and "balance_after" in r for r in train)
    assert sum("balance_cost_a" in r for r in records) == 1  # logged once, on the step it was fitted
    assert result["resumed"][3:] == result["straight"][3:]
    for k, p in result["straight_params"].items():
        assert torch.equal(result["resumed_params"][k], p), k


def test_balance_refused_where_it_cannot_apply(tmp_path: Path) -> None:
    from loong.core.config import compose_config
    from loong.llm.pretrain import PretrainTask
    from loong.llm.schema import LLMRunConfig
    from loong.llm.sft.task import SFTTask

    cfg, _ = compose_config("loong.llm.configs", "pretrain", ["data.balance.enabled=true"], LLMRunConfig)
    with pytest.raises(LoongError, match="nothing to balance"):
        PretrainTask.check_config(cfg)
    cfg, _ = compose_config("loong.llm.configs", "pretrain",
                            ["task=sft", "data.balance.enabled=true", "parallel.pp=2"], LLMRunConfig)
    with pytest.raises(LoongError, match="parallel.pp=2"):
        SFTTask.check_config(cfg)
    with pytest.raises(LoongError, match=r"data\.balance\.cost.*did you mean 'fit'"):
        compose_config("loong.llm.configs", "pretrain", ["data.balance.cost=fitt"], LLMRunConfig)
    with pytest.raises(LoongError, match="three non-negative"):
        compose_config("loong.llm.configs", "pretrain", ["data.balance.cost=[1,2]"], LLMRunConfig)


SPLITS = [  # (overrides, what a trimmed row's length must divide by)
    ([], 8),
    (["parallel.tp=3"], 8),  # no sequence parallelism: rows are not split over TP
    (["parallel.tp=2", "parallel.sequence_parallel=true"], 8),
    (["parallel.tp=3", "parallel.sequence_parallel=true"], 24),  # multiples of 8 were 2 in 3 times unsplittable
    (["parallel.tp=16", "parallel.sequence_parallel=true"], 16),
    (["model=qwen3_30b_a3b_4l", "parallel.tp=6"], 24),  # MoE at tp > 1 runs sequence-parallel, not asked for
    (["parallel.cp=3"], 24),  # 2 * cp chunks
    (["parallel.tp=4", "parallel.cp=2", "parallel.sequence_parallel=true"], 8),  # cp * tp
    (["parallel.tp=3", "parallel.cp=2", "parallel.sequence_parallel=true"], 24),
]


@pytest.mark.parametrize("overrides,multiple", SPLITS, ids=[" ".join(o) or "default" for o, _ in SPLITS])
def test_trimmed_rows_split_over_the_layout(overrides: list[str], multiple: int) -> None:
    from loong.core.config import compose_config
    from loong.llm.schema import LLMRunConfig
    from loong.llm.sft.balance import row_multiple, trimmed_length

    cfg, _ = compose_config("loong.llm.configs", "pretrain", ["task=sft", *overrides], LLMRunConfig)
    assert row_multiple(cfg.model, cfg.parallel) == multiple
    seq = 4 * multiple
    for longest in range(seq + 1):  # the longest row rounded up to the multiple (an empty micro-batch: one)
        assert trimmed_length(longest, seq, multiple) == max(multiple, -(-longest // multiple) * multiple), longest
    # a train.seq_length that the layout splits (check_config) but is no multiple of 24 caps the longest rows
    assert trimmed_length(95, 96, 24) == 96 and trimmed_length(75, 78, 24) == 78 and trimmed_length(0, 12, 24) == 12


def test_balanced_rows_under_tp3_sequence_parallelism() -> None:
    """Every row of every balanced micro-batch splits over tp=3 (rows of 40 slots stopped megatron in the first
    forward at tp=3 with sequence parallelism; seen on 3 gloo ranks), still trimmed below seq_length."""
    import numpy as np

    from loong.core.config import compose_config
    from loong.llm.data.text import GlobalBatchSampler
    from loong.llm.schema import LLMRunConfig
    from loong.llm.sft.balance import BalancedConversations
    from loong.llm.sft.packing import Document, PackedSequences

    cfg, _ = compose_config("loong.llm.configs", "pretrain", [
        "task=sft", "data.balance.enabled=true", "data.packing=false", "parallel.tp=3",
        "parallel.sequence_parallel=true", "train.seq_length=96", "train.global_batch_size=8",
        "train.micro_batch_size=2"], LLMRunConfig)
    rng = random.Random(0)
    docs = [Document(np.arange(n + 1), np.ones(n, dtype=bool)) for n in (rng.randint(3, 96) for _ in range(40))]
    data = PackedSequences(docs, 96, packing=False, pad_id=0)
    balanced = BalancedConversations(cfg, data, GlobalBatchSampler(len(data), seed=0), dp_size=1, dp_group=None)
    lengths = {len(row["tokens"]) for step in range(4) for rows in balanced.rows(step, 0)
               for row in balanced.row_arrays(rows)}
    assert all(n % 3 == 0 and (n % 24 == 0 or n == 96) for n in lengths), lengths
    assert min(lengths) < 96, lengths
