"""What a policy's training step does that a CUDA graph could not capture (the capture-safety tests' recorder)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch

from loong.core.errors import LoongError
from loong.core.host_sync import DeviceSyncRecorder
from loong.embodied.policies.base import FLOW_TIME_KEY


def record_step(policy: Any, inputs: Mapping[str, Any]) -> list[str]:
    """The sync-prone ops and host-data copies one forward + backward of ``policy`` on ``inputs`` calls (the
    gradients are cleared again; the loss must be finite)."""
    mode = DeviceSyncRecorder(host_data=True)
    with mode:
        mode.active = True
        loss, _ = policy(inputs)
        loss.backward()
        mode.active = False
    policy.zero_grad(set_to_none=True)
    assert loss.isfinite()
    return mode.seen


def loss_and_grads(policy: Any, inputs: Mapping[str, Any], noise: torch.Tensor,
                   time: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and every parameter gradient of one forward + backward (device-side draws seeded with 5)."""
    torch.manual_seed(5)
    loss, _ = policy(inputs, noise=noise, time=time)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad(set_to_none=True)
    return loss.detach(), grads


def check_host_drawn_times(policy: Any, inputs: dict[str, Any]) -> None:
    """A GR00T policy's ``host_draws`` draws the flow times ``sample_time`` would, leaves ``inputs`` alone, gives the
    loss and gradients of those times passed explicitly, and a wrong-shaped ``flow_time`` is refused by name."""
    b = inputs["action"].shape[0]
    torch.manual_seed(3)
    drawn = policy.host_draws(inputs)
    torch.manual_seed(3)
    assert torch.equal(drawn[FLOW_TIME_KEY], policy.action_head.sample_time(b))
    assert FLOW_TIME_KEY not in inputs
    noise = torch.randn(b, policy.config.chunk_size, policy.config.max_action_dim)
    a, a_grads = loss_and_grads(policy, drawn, noise, None)
    c, c_grads = loss_and_grads(policy, inputs, noise, drawn[FLOW_TIME_KEY])
    assert torch.equal(a, c)
    assert all(torch.equal(g, c_grads[n]) for n, g in a_grads.items())
    bad = dict(drawn)
    bad[FLOW_TIME_KEY] = torch.full((b - 1,), 0.5)
    with pytest.raises(LoongError, match="flow_time"):
        policy(bad)
