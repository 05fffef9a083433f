"""Context parallelism's pieces on one process: the zigzag split follows megatron-core's rotary layout, and the
configurations it does not cover are refused with the reason. CP=2 against one rank (loss, every gradient, 20 steps)
is in test_layouts (layout ``cp2``)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

from loong.core.accelerators import select_accelerator
from loong.core.config import compose_config
from loong.core.engines.megatron.context_parallel import cp_chunks, split_for_cp_rank
from loong.core.errors import LoongError
from loong.llm.pretrain import PretrainTask
from loong.llm.schema import LLMRunConfig


class _Group:
    """What megatron's rotary slice reads of a process group."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize("cp", [2, 4])
def test_split_matches_megatrons_rotary_slice_and_covers_the_sequence(cp: int) -> None:
    seq = 8 * cp
    positions = torch.arange(seq)
    table = positions.float()[:, None, None, None]  # [s, 1, 1, d] as megatron's rotary table
    pieces = []
    with select_accelerator("cpu").activate():  # megatron's slice pins and moves its index to CUDA
        for rank in range(cp):
            ours = split_for_cp_rank(positions[None], 1, cp, rank)[0]
            theirs = get_pos_emb_on_this_cp_rank(table, 0, _Group(cp, rank)).flatten().long()
            assert torch.equal(ours, theirs)
            a, b = cp_chunks(cp, rank)
            assert a + b == 2 * cp - 1  # an early chunk pairs with a late one: equal causal work
            pieces.append(ours)
    assert torch.equal(torch.cat(pieces).sort().values, positions)


def test_split_rejects_a_length_that_does_not_divide() -> None:
    with pytest.raises(ValueError, match="not divisible by 2 \\* cp = 4"):
        split_for_cp_rank(torch.zeros(1, 6), 1, 2, 0)


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.seq_length=30"], r"train\.seq_length=30 must divide by 2 \* cp = 4"),
])
def test_unsupported_context_parallel_configs_are_refused(overrides: list[str], message: str) -> None:
    cfg, _ = compose_config("loong.llm.configs", "pretrain", ["parallel.cp=2", *overrides], LLMRunConfig)
    with pytest.raises(LoongError, match=message):
        PretrainTask.check_config(cfg)
