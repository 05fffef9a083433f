"""Test-only: a toy VLA policy that solves the reach task from its top camera, and a run dir holding it.

The toy is no learned model: it finds the instructed colour and the agent in the top image and steps towards it.
That makes it a sharp probe of the inference path: it succeeds only if every conversion on the way is right
(uint8 HWC -> float CHW in [0, 1], the instruction's words, the state's normalisation in the processor and back
in the policy, the action's normalisation and its inverse in ``postprocess``, the chunk queue) and if the weights
come from the checkpoint: its ``gain`` is built as 0 (no motion) and the checkpoint holds 1, its ``ema.gain`` -1
(motion away from the target).

The run dir is written the way a ``loong-embodied train`` run leaves one: ``policy/policy.json`` and the
processor's files, and ``checkpoints/step_N`` through the core's ``CheckpointManager`` with the fsdp engine's DCP
layout (``model.<name>``, ``ema.<name>``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from loong.core.checkpoint import CheckpointManager
from loong.embodied.envs.reach import COLOURS, MAX_STEP, TOP_HALF_WIDTH
from loong.embodied.policies import POLICIES, PolicyConfig, PolicyProcessor, PolicySpec, VLAPolicy

NAME = "toy_reach"
VOCAB = ["<unk>", "reach", "the", "target", *sorted(COLOURS)]
#: the robot's state / action statistics the processor normalises with (saved with it, so a load must read them)
STATS = {"state_mean": [0.1, -0.2], "state_std": [0.5, 0.6], "action_mean": [0.05, -0.05], "action_std": [0.7, 0.8]}


@dataclass
class ToyConfig(PolicyConfig):
    """A tiny config: chunks of 4, 2 of them executed, padded to width 4."""

    chunk_size: int = 4
    n_action_steps: int = 2
    max_state_dim: int = 4
    max_action_dim: int = 4
    noise_scale: float = 0.01  # how much the flow-matching noise moves the actions (so a seed matters)


class ToyPolicy(VLAPolicy):
    """Steps towards the instructed colour's centroid in ``observation.images.top`` (see the module docstring)."""

    name = NAME

    def __init__(self, config: ToyConfig) -> None:
        super().__init__(config)
        self.gain = nn.Parameter(torch.zeros(()))
        # the robot's statistics, which a real policy would not need: the toy works in robot units
        self.register_buffer("state_stats", torch.tensor([STATS["state_mean"], STATS["state_std"]]))
        self.register_buffer("action_stats", torch.tensor([STATS["action_mean"], STATS["action_std"]]))
        self.register_buffer("palette", torch.tensor([[0.0, 0.0, 0.0]] * 4 + [list(COLOURS[c]) for c in
                                                                              sorted(COLOURS)]) / 255)
        self.calls = 0

    def loss(self, inputs: Mapping[str, torch.Tensor], *, noise: torch.Tensor | None = None,
             time: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        chunk = self.predict_action_chunk(inputs, noise=noise)
        loss = (chunk - inputs["action"]).square().mean()
        return loss, {"mse": loss.detach()}

    def predict_action_chunk(self, inputs: Mapping[str, torch.Tensor], *,
                             noise: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        cfg = self.config
        image = inputs["top"]  # [b, 3, h, w] in [0, 1]
        b, _, h, w = image.shape
        colour = self.palette[inputs["words"].max(dim=1).values]  # the colour word has the highest id
        coords = -TOP_HALF_WIDTH + (torch.arange(w, dtype=torch.float32) + 0.5) * (2 * TOP_HALF_WIDTH / w)
        xs, ys = coords.view(1, 1, w).expand(b, h, w), (-coords).view(1, h, 1).expand(b, h, w)
        match = ((image - colour.view(b, 3, 1, 1)).abs().amax(dim=1) < 0.02).float()  # [b, h, w]
        target = torch.stack([(match * xs).sum((1, 2)), (match * ys).sum((1, 2))], -1) / match.sum((1, 2)).clamp(
            min=1).unsqueeze(-1)
        mean, std = self.state_stats
        agent = inputs["state"][:, :2] * std + mean  # the processor normalised it
        step = ((target - agent) / MAX_STEP).clamp(-1, 1) * self.gain
        amean, astd = self.action_stats
        normalised = (step - amean) / astd
        out = torch.zeros(b, cfg.chunk_size, cfg.max_action_dim)
        out[..., :2] = normalised.unsqueeze(1)
        if noise is None:
            noise = torch.randn_like(out)
        return out + cfg.noise_scale * noise.to(out.dtype)


class ToyProcessor(PolicyProcessor):
    """Raw batches to ``{"top", "state", "words"}``; actions unnormalised with the saved statistics."""

    camera_keys = ["observation.images.top", "observation.images.wrist"]

    def __init__(self, config: ToyConfig, stats: Mapping[str, list[float]] = STATS,
                 vocab: list[str] = VOCAB) -> None:
        self.config = config
        self.stats = {k: torch.tensor(v) for k, v in stats.items()}
        self.vocab = list(vocab)

    def __call__(self, batch: Mapping[str, Any], *, train: bool = True) -> dict[str, torch.Tensor]:
        state = (batch["observation.state"] - self.stats["state_mean"]) / self.stats["state_std"]
        padded = torch.zeros(state.shape[0], self.config.max_state_dim)
        padded[:, : state.shape[1]] = state
        ids = [[self.vocab.index(w) if w in self.vocab else 0 for w in task.split()] for task in batch["task"]]
        width = max(len(i) for i in ids)
        words = torch.tensor([i + [0] * (width - len(i)) for i in ids])
        out = {"top": batch["observation.images.top"].float(), "state": padded, "words": words}
        if train:
            out["action"] = torch.zeros(state.shape[0], self.config.chunk_size, self.config.max_action_dim)
        return out

    def postprocess(self, actions: torch.Tensor) -> torch.Tensor:
        return actions[..., :2] * self.stats["action_std"] + self.stats["action_mean"]

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "toy_processor.json").write_text(json.dumps({"stats": STATS, "vocab": self.vocab}))

    @classmethod
    def load(cls, directory: Path, config: PolicyConfig) -> ToyProcessor:
        data = json.loads((directory / "toy_processor.json").read_text())
        assert isinstance(config, ToyConfig)
        return cls(config, data["stats"], data["vocab"])


SPEC = PolicySpec(name=NAME, config_class=ToyConfig, policy_class=ToyPolicy, processor_class=ToyProcessor,
                  presets={"tiny": ToyConfig()})


def register() -> None:
    """Put the toy in the registry (the same object again is allowed)."""
    POLICIES.add(NAME, SPEC)


class _Weights:
    """What ``CheckpointManager.save`` needs of an engine: write the DCP state."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def save(self, directory: Path) -> None:
        dcp.save(self.state, checkpoint_id=str(directory))


def write_run(run_dir: Path, *, steps: tuple[int, ...] = (5,), gain: float = 1.0, ema_gain: float | None = -1.0,
              config: ToyConfig | None = None) -> Path:
    """A run dir of the toy with a checkpoint per step in ``steps`` (the newest holds ``gain``; older ones 0);
    returns the newest step dir."""
    register()
    config = config or ToyConfig()
    policy_dir = run_dir / "policy"
    policy_dir.mkdir(parents=True, exist_ok=True)
    (policy_dir / "policy.json").write_text(json.dumps({"policy": NAME, "config": asdict(config)}))
    ToyProcessor(config).save(policy_dir)
    manager = CheckpointManager(run_dir / "checkpoints", keep_last=0)
    last = None
    for i, step in enumerate(sorted(steps)):
        model = ToyPolicy(config)
        with torch.no_grad():
            model.gain.fill_(gain if i == len(steps) - 1 else 0.0)
        state: dict[str, Any] = {"model": dict(model.state_dict())}
        if ema_gain is not None:
            state["ema"] = {"gain": torch.tensor(ema_gain)}
        last = manager.save(step, _Weights(state), {"step": step}, {"policy": NAME})
    manager.wait()
    assert last is not None
    return last
