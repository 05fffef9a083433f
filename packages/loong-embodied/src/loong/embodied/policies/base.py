"""What every VLA policy is: a config, an ``nn.Module`` with a loss and an action sampler, and a host-side processor.

The split is LeRobot's (a policy = config + model + processor) with the training loop taken out: the fsdp engine
trains :class:`VLAPolicy` as any ``nn.Module`` (its :meth:`~VLAPolicy.blocks` are sharded, recomputed and
compiled one by one), the task feeds it what the :class:`PolicyProcessor` made of a :class:`VLADataset` batch.

Data flow, one batch::

    VLADataset samples --collate_vla--> raw batch           (cameras float [b, c, h, w] in [0, 1], state [b, s],
                                                             action [b, chunk, a], action_is_pad [b, chunk],
                                                             task: list[str], optional embodiment_id [b])
        --PolicyProcessor(raw)-->        model inputs        (dict of tensors only: normalised state/actions padded
                                                             to max dims, tokens, image tensors, masks), host side,
                                                             in DataLoader workers
        --VLAPolicy.loss(inputs)-->      scalar loss          (training)
        --VLAPolicy.predict_action_chunk(inputs)--> [b, chunk_size, max_action_dim] normalised actions
        --PolicyProcessor.postprocess--> [b, chunk_size, action_dim] robot actions (unnormalised)
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn


@dataclass
class PolicyConfig:
    """Fields every policy has (each policy's config subclasses this and adds its own).

    ``chunk_size``: actions predicted per call (the action horizon); ``n_action_steps``: how many of them
    :meth:`VLAPolicy.select_action` executes before predicting again; ``max_state_dim`` / ``max_action_dim``:
    state and actions are zero-padded to these widths (one model serves robots of different widths);
    ``num_inference_steps``: flow-matching integration steps at inference.
    """

    chunk_size: int = 50
    n_action_steps: int = 50
    max_state_dim: int = 32
    max_action_dim: int = 32
    num_inference_steps: int = 10

    def replace(self, **changes: Any) -> PolicyConfig:
        """A copy with ``changes`` applied (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


#: the inputs key of the flow-matching times :meth:`VLAPolicy.host_draws` drew on the host (``[b]`` fp32); a
#: policy's :meth:`VLAPolicy.loss` takes them from there when its ``time`` argument is None
FLOW_TIME_KEY = "flow_time"


class VLAPolicy(nn.Module, ABC):
    """A vision-language-action policy: the trained module.

    Subclasses build their backbone and action head in ``__init__`` from ``config`` (random init, fp32, on the
    host) and set ``requires_grad=False`` on what the config freezes (``tune_llm=False``, ...), so the engine
    gives it neither gradients nor optimiser state.
    """

    #: the registry name (``pi05``, ``groot_n1_7``, ``groot_n1_6``)
    name: ClassVar[str]
    #: whether :meth:`loss` on inputs that :meth:`host_draws` completed can be captured in a CUDA graph
    #: (``train.cuda_graphs``): no device-to-host sync, no host tensor copied to the device, no host-side draw
    cuda_graph_safe: ClassVar[bool] = False

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__()
        self.config = config
        self._queue: deque[torch.Tensor] = deque()

    @abstractmethod
    def loss(self, inputs: Mapping[str, torch.Tensor], *, noise: torch.Tensor | None = None,
             time: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's scalar training loss and detached metrics.

        ``noise`` ``[b, chunk_size, max_action_dim]`` and ``time`` ``[b]`` fix the flow-matching draw (the parity
        tests pass lerobot's); ``None`` draws them from the global generator as the published recipe does.
        """

    @abstractmethod
    def predict_action_chunk(self, inputs: Mapping[str, torch.Tensor], *,
                             noise: torch.Tensor | None = None) -> torch.Tensor:
        """``[b, chunk_size, max_action_dim]`` normalised actions, integrated from ``noise`` (drawn when None)
        over ``config.num_inference_steps`` steps. Called under ``torch.no_grad`` by :meth:`select_action`."""

    def forward(self, inputs: Mapping[str, torch.Tensor], *, noise: torch.Tensor | None = None,
                time: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """:meth:`loss`: training calls the module itself, since the engine's wrappers (FSDP2's root unsharding,
        DDP's gradient sync) hook ``forward``, which a direct ``policy.loss(...)`` would bypass."""
        return self.loss(inputs, noise=noise, time=time)

    def host_draws(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """``inputs`` with the random draws :meth:`loss` takes from the host (CPU) generator added as tensors, so
        that the device step that follows draws only on the device (and can be a replayed CUDA graph). Called by
        the task after it seeds the micro-batch's generators, in the order the loss would draw. Default: none."""
        return dict(inputs)

    def blocks(self) -> list[nn.Module]:
        """The repeated transformer blocks, in order (the units FSDP2 shards and recomputation wraps);
        default: none (the whole model is one unit)."""
        return []

    def reset(self) -> None:
        """Forget queued actions (call at the start of every episode)."""
        self._queue.clear()

    @torch.no_grad()
    def select_action(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The next ``[b, max_action_dim]`` normalised action: a new chunk is predicted when the queue is empty,
        and its first ``n_action_steps`` actions are executed in turn (lerobot's ``select_action``)."""
        if not self._queue:
            chunk = self.predict_action_chunk(inputs)[:, : self.config.n_action_steps]
            self._queue.extend(chunk.transpose(0, 1))
        return self._queue.popleft()


class PolicyProcessor(ABC):
    """The host side of a policy: raw batches in, model inputs out; normalised actions back to robot actions.

    It holds what must travel with a trained policy: the normalisation statistics and the tokenizer (or
    processor) folder, written by :meth:`save` next to the weights and read back by :meth:`load`.
    """

    @abstractmethod
    def __call__(self, batch: Mapping[str, Any], *, train: bool = True) -> dict[str, torch.Tensor]:
        """The model inputs of a raw :func:`~loong.embodied.data.dataset.collate_vla` batch (or of one robot
        observation batched by :meth:`observation_batch`); ``train=False``: no ``action`` key is needed."""

    @abstractmethod
    def postprocess(self, actions: torch.Tensor) -> torch.Tensor:
        """Robot actions ``[..., action_dim]`` from the policy's normalised ``[..., max_action_dim]`` ones."""

    @abstractmethod
    def save(self, directory: Path) -> None:
        """Write what :meth:`load` needs into ``directory`` (statistics, tokenizer files, feature names)."""

    @classmethod
    @abstractmethod
    def load(cls, directory: Path, config: PolicyConfig) -> PolicyProcessor:
        """The processor :meth:`save` wrote."""


@dataclass(frozen=True)
class PolicySpec:
    """A registered policy: its pieces and presets (registered in :data:`loong.embodied.policies.POLICIES`).

    ``lerobot``: ``"package.module"`` of its LeRobot mapping (``to_lerobot`` / ``from_lerobot``), or None for a
    policy lerobot does not ship.
    """

    name: str
    config_class: type[PolicyConfig]
    policy_class: type[VLAPolicy]
    processor_class: type[PolicyProcessor]
    presets: Mapping[str, PolicyConfig]
    lerobot: str | None = None


__all__ = ["FLOW_TIME_KEY", "PolicyConfig", "PolicyProcessor", "PolicySpec", "VLAPolicy"]
