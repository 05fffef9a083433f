"""Packed training of the ``diffusion.wan`` task on one process (``data.pack_tokens``, mixed ``data.sizes``).

The oracle is the unpacked run over the same global batch (``train.micro_batch_size=1``: each clip its own
micro-batch, the engine's mean of their MSEs): a packed step, its micro-batches cut by the token budget, gives the
same loss and the same gradient of every parameter; so does its evaluation. The plan of a step is the same on
every data-parallel rank, uses every clip once, keeps every micro-batch within the budget and lowers the most
loaded rank's cost; and the two ranks' losses average to the one-rank loss.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from loong.core.accelerators import select_accelerator
from loong.core.attention import CPGroups
from loong.core.config import from_dict
from loong.core.errors import LoongError
from loong.diffusion.schema import DiffusionRunConfig
from loong.diffusion.task import WanTask

#: latent sizes of 64, 16, 4 and 48 video tokens (patch 1 × 2 × 2)
SIZES = [[4, 8, 8], [2, 8, 4], [1, 4, 4], [2, 12, 8]]
BUDGET = 80
#: fp32, relative to the reference (measured: losses equal to ~1e-7, gradients ~1e-6 of the largest entry)
TOLERANCE = 1e-5


def _task(pack: int, dp: int = 1, dp_rank: int = 0, mbs: int = 8, **data: Any) -> WanTask:
    cfg = from_dict(DiffusionRunConfig, {
        "data": {"sizes": SIZES, "pack_tokens": pack, "num_clips": 16, **data},
        "train": {"global_batch_size": 8, "micro_batch_size": mbs, "precision": "fp32"}})
    WanTask.check_config(cfg)
    task = WanTask(cfg, select_accelerator(), types.SimpleNamespace(dp=dp, dp_rank=dp_rank, cp_groups=CPGroups()))
    task.setup_data()
    return task


def _step(task: WanTask, model: torch.nn.Module, step: int, dp: int = 1) -> tuple[float, dict[str, torch.Tensor]]:
    """What the engine does on one rank: the mean of the micro-batch losses, backward through ``loss / nmb``."""
    nmb = task.num_train_microbatches(step, 8 // (task.mbs * dp))
    total = 0.0
    for batch in task.train_microbatches(step, nmb):
        loss, _ = task.loss(model, batch)
        (loss / nmb).backward()
        total += float(loss.detach()) / nmb
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return total, grads


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def test_a_packed_step_equals_the_unpacked_clips() -> None:
    packed, unpacked = _task(BUDGET), _task(0, mbs=1)
    torch.manual_seed(0)
    model = packed.build_model()
    reference = unpacked.build_model()
    reference.wan.load_state_dict(model.wan.state_dict())
    sizes = {tuple(packed.dataset.size_of(i)) for i in range(8)}
    assert len(sizes) >= 3, sizes  # the step mixes sizes
    assert packed.num_train_microbatches(0, 1) >= 3  # 8 clips of 4..64 tokens need several budgets of 80
    for batch in packed.train_microbatches(0, packed.num_train_microbatches(0, 1)):
        assert int((batch["doc_ids"] >= 0).sum()) <= BUDGET

    got_loss, got_grads = _step(packed, model, 0)
    want_loss, want_grads = _step(unpacked, reference, 0)
    assert abs(got_loss - want_loss) <= TOLERANCE * want_loss
    for name, want in want_grads.items():
        assert _error(got_grads[name], want) <= TOLERANCE, name

    with torch.no_grad():  # evaluation: packed within the budget too (its own micro-batch count), the same clip mean
        def evaluated(task: WanTask, m: torch.nn.Module, nmb: int) -> float:
            return sum(float(task.loss(m, b)[0]) for b in task.eval_microbatches(0, nmb)) / nmb
        nmb = packed.num_eval_microbatches(0, 1)
        assert nmb >= 3 and unpacked.num_eval_microbatches(0, 8) == 8
        for batch in packed.eval_microbatches(0, nmb):
            assert int((batch["doc_ids"] >= 0).sum()) <= BUDGET
        assert evaluated(packed, model, nmb) == pytest.approx(evaluated(unpacked, reference, 8), rel=TOLERANCE)


def test_the_plan_is_one_for_every_rank_and_balances_the_step() -> None:
    ranks = [_task(BUDGET, dp=2, dp_rank=r, mbs=4) for r in (0, 1)]
    again = _task(BUDGET, dp=2, dp_rank=1, mbs=4)
    for step in range(3):
        plans = [t.packer.plan(step * 8) for t in ranks]
        assert plans[0].micro_batches == plans[1].micro_batches == again.packer.plan(step * 8).micro_batches
        positions = sorted(p for rank in plans[0].micro_batches for mb in rank for p in mb)
        assert positions == list(range(8))  # every clip of the global batch once
        for rank in plans[0].micro_batches:
            assert all(sum(int(plans[0].lengths[p]) for p in mb) <= BUDGET for mb in rank)
        assert plans[0].after <= plans[0].before
        assert ranks[0].num_train_microbatches(step, 1) == ranks[1].num_train_microbatches(step, 1)
    metrics = ranks[0].after_train_step(0, {})
    assert set(metrics) >= {"balance_before", "balance_after", "micro_batches", "pack_fill"}


def test_two_ranks_average_to_the_one_rank_loss() -> None:
    """The weighting makes the engine's mean over ranks and micro-batches the clips' mean, whatever the plan; here
    (data.seed 3) rank 1 has an empty micro-batch and packs a clip of weight 0 there."""
    one = _task(BUDGET, seed=3)
    torch.manual_seed(0)
    model = one.build_model()
    want, _ = _step(one, model, 0)
    ranks = [_task(BUDGET, dp=2, dp_rank=r, mbs=4, seed=3) for r in (0, 1)]
    assert [] in ranks[1].packer.plan(0).micro_batches[1]
    halves = [_step(task, model, 0, dp=2)[0] for task in ranks]
    assert sum(halves) / 2 == pytest.approx(want, rel=TOLERANCE)


def test_packing_config_checks_name_the_keys() -> None:
    with pytest.raises(LoongError, match=r"data.pack_tokens=40 is less than the largest clip's 64 video tokens"):
        _task(40)
    with pytest.raises(LoongError, match=r"data.sizes holds several sizes.*train.micro_batch_size=2"):
        _task(0, mbs=2)
    with pytest.raises(LoongError, match=r"data.sizes\[1\]=\[2, 7, 4\]"):
        _task(BUDGET, sizes=[[4, 8, 8], [2, 7, 4]])
    with pytest.raises(LoongError, match=r"data.sizes\[0\]=\[4, 8\]: a latent size"):
        _task(BUDGET, sizes=[[4, 8]])
    with pytest.raises(LoongError, match=r"data.pack_tokens=-1: must be >= 0 \(0: no packing\)"):
        _task(-1)
