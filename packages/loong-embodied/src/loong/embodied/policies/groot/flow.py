"""GR00T's flow matching: time sampling, the noisy interpolant, the masked velocity loss, the Euler sampler.

GR00T's convention (lerobot ``groot_n1_7.py``, Isaac-GR00T ``gr00t_n1d6.py``) runs time the other way round from
Pi0.5: ``t = 0`` is pure noise and ``t = 1`` the clean chunk::

    u ~ Beta(alpha, beta);  t = (1 - u) * noise_s                  # noise_s = 0.999 keeps t < 1
    x_t = (1 - t) * noise + t * actions;   target velocity v = actions - noise
    timestep = floor(t * num_timestep_buckets)                      # what the DiT and action encoder see
    loss = sum(mask * (v_pred - v)^2) / (sum(mask) + 1e-6)

Sampling integrates ``x <- x + v_pred / n`` from noise at ``t = k / n``, ``k = 0 .. n-1``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch.distributions import Beta

from loong.core.errors import LoongError
from loong.embodied.policies.base import FLOW_TIME_KEY


def sample_time(batch_size: int, *, alpha: float = 1.5, beta: float = 1.0, noise_s: float = 0.999,
                device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[batch_size]`` flow times ``t = (1 - u) * noise_s``, ``u ~ Beta(alpha, beta)``.

    Drawn on the host from the global generator (the distribution's parameters are host fp32 tensors, as GR00T
    builds them), so the same seed gives the same times as lerobot / Isaac-GR00T.
    """
    dist = Beta(torch.tensor(alpha, dtype=torch.float32), torch.tensor(beta, dtype=torch.float32),
                validate_args=False)
    u = dist.sample([batch_size]).to(device, dtype=dtype)
    return (1 - u) * noise_s


def with_host_times(inputs: Mapping[str, torch.Tensor], draw: Callable[[int], torch.Tensor],
                    where: str) -> dict[str, torch.Tensor]:
    """A GR00T policy's ``host_draws``: ``inputs`` with ``[b]`` flow times under ``FLOW_TIME_KEY``, from ``draw``
    (the head's :func:`sample_time`, the host generator's Beta draws), which the loss then takes; the noise and the
    state dropout stay on the device. On a GPU that is GR00T's stream of draws (lerobot draws the Beta times on the
    host and the rest on the device, from two generators); on a CPU, where one generator makes every draw, the
    times now come first."""
    if "action" not in inputs:
        raise LoongError(f"{where} host_draws: model inputs lack 'action' (made by the processor with train=True)")
    out = dict(inputs)
    out[FLOW_TIME_KEY] = draw(inputs["action"].shape[0])
    return out


def host_times(inputs: Mapping[str, torch.Tensor], where: str) -> torch.Tensor | None:
    """The flow times :func:`with_host_times` put in ``inputs`` (None: none there), checked to be one a sample."""
    time = inputs.get(FLOW_TIME_KEY)
    if time is not None and tuple(time.shape) != tuple(inputs["action"].shape[:1]):
        raise LoongError(f"{where} loss: flow times ('{FLOW_TIME_KEY}') of shape {list(time.shape)}; "
                         f"expected [{inputs['action'].shape[0]}] (one per sample)")
    return time


def discretize_time(t: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """``floor(t * num_buckets)`` as long (``t >= 0``): the timestep index the networks are conditioned on."""
    return (t * num_buckets).long()


def noisy_actions(actions: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_t, velocity)`` for actions/noise ``[b, h, a]`` and times ``t`` ``[b]``."""
    tt = t[:, None, None]
    return (1 - tt) * noise + tt * actions, actions - noise


def masked_velocity_loss(pred: torch.Tensor, velocity: torch.Tensor,
                         mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, per_element_loss)``: MSE over the entries where ``mask`` ``[b, h, a]`` is 1, as GR00T sums it."""
    per_element = F.mse_loss(pred, velocity, reduction="none") * mask
    return per_element.sum() / (mask.sum() + 1e-6), per_element


def euler_sample(velocity_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], noise: torch.Tensor, *,
                 num_steps: int, num_buckets: int) -> torch.Tensor:
    """Integrate ``dx/dt = velocity_fn(x, timestep)`` from ``noise`` (t=0) to t=1 in ``num_steps`` Euler steps.

    ``velocity_fn(x [b, h, a], timesteps [b] long) -> [b, h, a]``; step ``k`` uses ``timestep = int(k / n *
    num_buckets)``, the same integer for the whole batch.
    """
    x = noise
    dt = 1.0 / num_steps
    for step in range(num_steps):
        bucket = int(step / float(num_steps) * num_buckets)
        timesteps = torch.full((x.shape[0],), bucket, device=x.device)
        x = x + dt * velocity_fn(x, timesteps)
    return x


__all__ = ["discretize_time", "euler_sample", "masked_velocity_loss", "noisy_actions", "sample_time"]
