"""Pi0.5's training step is capture-safe (``cuda_graph_safe``; one CPU process, fp32).

- The device step (``policy(inputs)``: the loss forward and its backward, on inputs the processor made and
  :meth:`~loong.embodied.task.VLATask.prepare` completed) calls no op that, on a GPU, makes the host wait for the
  device (``item``, ``nonzero``, boolean indexing, ``repeat_interleave`` without ``output_size``, ...) and none
  that makes a tensor from host data (``torch.tensor``: a host-to-device copy): a dispatch mode records them.
  On the CPU these ops cost nothing, so the check is on the ops called, not on time.
- The flow times are drawn on the host by :meth:`Pi05Policy.host_draws` (``inputs[FLOW_TIME_KEY]``): the loss and
  every gradient with them equal those with the same times passed as ``time=``; without the key (direct callers)
  the loss draws them itself, with the same sampler.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import pytest
import torch

from loong.core.host_sync import DeviceSyncRecorder
from loong.embodied.policies import POLICIES
from loong.embodied.policies.base import FLOW_TIME_KEY
from loong.embodied.policies.pi05.model import sample_time
from loong.embodied.task import SEED_KEY, VLATask

sys.path.insert(0, str(Path(__file__).parent))  # the shared fixtures module beside this file
import pi05_testing as pt  # noqa: E402

#: code the CPU run takes where a GPU takes another path: loong-kernels' plain-PyTorch RMSNorm reference (a GPU
#: runs its Triton kernel); the ops it calls are recorded apart, in ``other_paths_seen``
OTHER_PATHS = ("loong/kernels/norm.py",)


def _tiny(b: int = 4, seed: int = 0):  # noqa: ANN202
    spec = POLICIES.get("pi05")
    config = spec.presets["tiny"]
    torch.manual_seed(seed)
    policy = spec.policy_class(config)
    processor = spec.processor_class(config, features=pt.features(), stats=pt.stats(), camera_keys=pt.CAMERAS)
    raw = pt.raw_batch(b)
    raw["action"] = torch.cat([raw["action"], raw["action"]], dim=1)  # the tiny preset's chunk of 8
    raw["action_is_pad"] = torch.cat([raw["action_is_pad"]] * 2, dim=1)
    del raw[pt.CAMERAS[1]]  # a masked camera slot, so the prefix has padding of both kinds
    return policy, processor, raw


def _prepared(policy, processor, raw, seed: int = 11) -> dict:  # noqa: ANN001
    """The processor's output completed as the task's ``prepare`` does (seed, then the policy's host draws)."""
    batch = processor(raw)
    batch[SEED_KEY] = seed
    return VLATask.prepare(None, policy, batch)  # type: ignore[arg-type]  # prepare reads no task state


def _grads(policy) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}


def test_pi05_is_declared_capture_safe():
    assert POLICIES.get("pi05").policy_class.cuda_graph_safe


def test_the_training_step_never_syncs_the_device_nor_copies_from_the_host():
    policy, processor, raw = _tiny()
    inputs = _prepared(policy, processor, raw)
    assert inputs[FLOW_TIME_KEY].shape == (4,) and inputs[FLOW_TIME_KEY].dtype == torch.float32
    mode = DeviceSyncRecorder(host_data=True, other_paths=OTHER_PATHS)
    with mode:
        mode.active = True
        loss, _ = policy(inputs)
        loss.backward()
        mode.active = False
    assert loss.isfinite()
    assert mode.seen == [], "device syncs / host data in the step:\n" + "\n".join(sorted(set(mode.seen)))


def test_the_recorder_sees_the_loss_drawing_its_own_times():
    """The control: without the host draws, the loss's own Beta draw (host data, host reads) is recorded."""
    policy, processor, raw = _tiny()
    inputs = processor(raw)
    mode = DeviceSyncRecorder(host_data=True, other_paths=OTHER_PATHS)
    with mode:
        mode.active = True
        policy(inputs)
        mode.active = False
    lines, start = inspect.getsourcelines(sample_time)
    in_sampler = range(start, start + len(lines))
    assert mode.seen and all(any(int(n) in in_sampler for n in re.findall(r"pi05/model\.py:(\d+)", s))
                             for s in mode.seen), mode.seen
    assert any("aten.lift_fresh" in s for s in mode.seen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_embedding_scale_and_the_mask_are_the_former_ones(dtype: torch.dtype):
    """The token embeddings' ``sqrt(width)`` scale (a device fill now, was ``float(torch.tensor(...))``) and the
    actions' block start (``arange == 0``, was an item assignment) give the former values."""
    policy, processor, raw = _tiny()
    policy = policy.to(dtype)
    inputs = processor(raw)
    emb, pad, _ = policy.embed_prefix(inputs)
    weight = policy.embed_tokens.weight
    former = policy.embed_tokens(inputs["tokens"]) * float(torch.tensor(weight.shape[1] ** 0.5, dtype=dtype))
    assert emb.dtype == dtype
    assert torch.equal(emb[:, -inputs["tokens"].shape[1]:], former)
    chunk = policy.config.chunk_size
    blocks = torch.zeros(chunk, dtype=torch.long)
    blocks[0] = 1
    assert torch.equal((torch.arange(chunk) == 0).long(), blocks)


def test_flow_times_of_another_batch_size_are_refused():
    from loong.core.errors import LoongError

    policy, processor, raw = _tiny()
    inputs = processor(raw)
    inputs[FLOW_TIME_KEY] = torch.full((3,), 0.5)
    with pytest.raises(LoongError, match="flow_time"):
        policy(inputs)


def test_host_drawn_times_equal_times_passed_explicitly():
    policy, processor, raw = _tiny()
    inputs = _prepared(policy, processor, raw)
    time = inputs[FLOW_TIME_KEY].clone()
    torch.manual_seed(5)
    loss, _ = policy(inputs)
    loss.backward()
    ours = _grads(policy)
    policy.zero_grad(set_to_none=True)
    torch.manual_seed(5)  # the same noise (drawn in the loss)
    explicit = {k: v for k, v in inputs.items() if k != FLOW_TIME_KEY}
    theirs_loss, _ = policy(explicit, time=time)
    theirs_loss.backward()
    theirs = _grads(policy)
    assert torch.equal(loss, theirs_loss)
    assert set(ours) == set(theirs) and ours
    for name, g in ours.items():
        assert torch.equal(g, theirs[name]), name


def test_host_draws_use_the_loss_sampler():
    policy, processor, raw = _tiny()
    inputs = processor(raw)
    torch.manual_seed(3)
    drawn = policy.host_draws(inputs)[FLOW_TIME_KEY]
    torch.manual_seed(3)
    assert torch.equal(drawn, sample_time(4, policy.config, torch.device("cpu")))
    assert ((drawn >= policy.config.time_sampling_offset) & (drawn <= 1.0)).all()
    assert FLOW_TIME_KEY not in inputs  # the processor's dict is not changed


@pytest.mark.parametrize("given", [True, False], ids=["time_given", "time_drawn"])
def test_the_loss_without_host_draws_still_draws_its_own_times(given: bool):
    policy, processor, raw = _tiny()
    inputs = processor(raw)
    torch.manual_seed(4)
    noise = torch.randn(4, policy.config.chunk_size, policy.config.max_action_dim)
    time = sample_time(4, policy.config, torch.device("cpu"))
    expected, _ = policy.loss(inputs, noise=noise, time=time)
    torch.manual_seed(4)
    torch.randn(4, policy.config.chunk_size, policy.config.max_action_dim)  # the noise's draw, as above
    got, _ = policy.loss(inputs, noise=noise, time=time if given else None)
    assert torch.equal(got, expected)
