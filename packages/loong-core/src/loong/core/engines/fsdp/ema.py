"""An exponential moving average of the weights (``train.ema_decay``), kept beside the fsdp engine's parameters.

After every optimiser step that was applied, each trainable parameter's average moves towards it:
``ema = decay·ema + (1 − decay)·weight`` (a constant decay, as openpi and the diffusers training scripts use by
default). The average starts as a copy of the weights the run starts from (the initialisation, a
``model.init_from_diffusers`` folder or a weights-only ``convert`` checkpoint).

The averages are tensors of the parameters' own kind: under FSDP2 a DTensor of the same sharding (each rank keeps
the average of its shard, in the fp32 of the master weights, on the parameters' device — host memory with
``parallel.fsdp_cpu_offload``), under DDP a whole tensor. The update is elementwise on the local shards, so a
sharded average equals the unsharded one; in a checkpoint they are the ``ema.<parameter name>`` tensors, which
DCP reshards like the weights. Frozen parameters have none (their average is their value).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class WeightEMA:
    """The moving averages of ``params`` (``(name, parameter)`` pairs; names as in the model's state dict)."""

    def __init__(self, params: Iterable[tuple[str, nn.Parameter]], decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"an EMA decay lies in (0, 1), got {decay}")
        self.decay = decay
        named = list(params)
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.averages = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        """One step: ``ema ← ema + (1 − decay)·(weight − ema)`` for every parameter, on the local shards."""
        torch._foreach_lerp_([_local(a) for a in self.averages], [_local(p) for p in self.params], 1.0 - self.decay)

    @torch.no_grad()
    def reset(self) -> None:
        """Restart every average at the current weights (a resume from a checkpoint that holds none)."""
        for average, p in zip(self.averages, self.params, strict=True):
            _local(average).copy_(_local(p))

    @torch.no_grad()
    def copy_to_params(self) -> None:
        """Overwrite the weights with their averages (the last act of a run that exports the EMA)."""
        for average, p in zip(self.averages, self.params, strict=True):
            _local(p).copy_(_local(average))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averages by parameter name: the tensors themselves, so that DCP loads into them in place."""
        return dict(zip(self.names, self.averages, strict=True))


__all__ = ["WeightEMA"]
