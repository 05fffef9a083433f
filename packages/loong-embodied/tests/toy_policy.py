"""A test-only toy VLA policy (``toy``): two small conv towers over the cameras, the instruction's characters,
the state, and a flow-matching MLP head. It exercises the task's seams (processor in DataLoader workers, noise
drawn from the global generator, ``blocks()``) in a fraction of a second per step; importing this module
registers it in :data:`loong.embodied.policies.POLICIES`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loong.embodied.data.normalize import Normalizer
from loong.embodied.policies import POLICIES
from loong.embodied.policies.base import PolicyConfig, PolicyProcessor, PolicySpec, VLAPolicy

TEXT_LEN = 32


@dataclass
class ToyConfig(PolicyConfig):
    chunk_size: int = 4
    n_action_steps: int = 4
    max_state_dim: int = 4
    max_action_dim: int = 4
    num_inference_steps: int = 4
    width: int = 32
    num_blocks: int = 2


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class ToyPolicy(VLAPolicy):
    name = "toy"

    def __init__(self, config: ToyConfig) -> None:
        super().__init__(config)
        w = config.width
        self.image = nn.Sequential(nn.Conv2d(3, 8, 4, 4), nn.GELU(), nn.Conv2d(8, 16, 4, 4), nn.GELU(),
                                   nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, w))
        self.text = nn.EmbeddingBag(128, w)
        self.state = nn.Linear(config.max_state_dim, w)
        self.time = nn.Linear(1, w)
        self.action_in = nn.Linear(config.chunk_size * config.max_action_dim, w)
        self.blocks_ = nn.ModuleList(Block(w) for _ in range(config.num_blocks))
        self.out = nn.Linear(w, config.chunk_size * config.max_action_dim)

    def blocks(self) -> list[nn.Module]:
        return list(self.blocks_)

    def _velocity(self, inputs: Mapping[str, torch.Tensor], x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.image(inputs["images"].flatten(0, 1)).unflatten(0, inputs["images"].shape[:2]).sum(1)
        h = h + self.text(inputs["text"]) + self.state(inputs["state"]) + self.time(t[:, None])
        h = h + self.action_in(x.flatten(1))
        for block in self.blocks_:
            h = block(h)
        return self.out(h).view_as(x)

    def loss(self, inputs: Mapping[str, torch.Tensor], *, noise: torch.Tensor | None = None,
             time: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        actions = inputs["action"]
        noise = torch.randn_like(actions) if noise is None else noise
        time = torch.rand(actions.shape[0], device=actions.device) if time is None else time
        x_t = time[:, None, None] * noise + (1 - time[:, None, None]) * actions
        err = (self._velocity(inputs, x_t, time) - (noise - actions)) ** 2
        keep = (~inputs["action_is_pad"]).to(err.dtype)[:, :, None]
        return (err * keep).mean(), {}

    def predict_action_chunk(self, inputs: Mapping[str, torch.Tensor], *,
                             noise: torch.Tensor | None = None) -> torch.Tensor:
        c = self.config
        b = inputs["state"].shape[0]
        x = torch.randn(b, c.chunk_size, c.max_action_dim) if noise is None else noise
        dt = 1.0 / c.num_inference_steps
        for i in range(c.num_inference_steps):
            t = torch.full((b,), 1.0 - i * dt)
            x = x - dt * self._velocity(inputs, x, t)
        return x


class ToyProcessor(PolicyProcessor):
    def __init__(self, config: ToyConfig, normalizer: Normalizer, meta: dict[str, Any]) -> None:
        self.config, self.normalizer, self.meta = config, normalizer, meta

    @classmethod
    def from_dataset(cls, config: ToyConfig, dataset: Any) -> ToyProcessor:
        norm = Normalizer.from_dataset(dataset, {"STATE": "MEAN_STD", "ACTION": "MEAN_STD"})
        meta = {"cameras": list(dataset.camera_keys), "state_dim": dataset.state_dim,
                "action_dim": dataset.action_dim, "stats": {k: {s: v.tolist() for s, v in st.items()}
                                                            for k, st in norm.stats.items()},
                "features": {k: dict(dataset.meta.features[k]) for k in
                             (*dataset.camera_keys, dataset.state_key, dataset.action_key)}}
        return cls(config, norm, meta)

    def __call__(self, batch: Mapping[str, Any], *, train: bool = True) -> dict[str, torch.Tensor]:
        c = self.config
        batch = self.normalizer.normalize(batch)
        state = batch["observation.state"].float()
        out = {"images": torch.stack([batch[k] for k in self.meta["cameras"]], 1).float(),
               "state": torch.nn.functional.pad(state, (0, c.max_state_dim - state.shape[-1])),
               "text": torch.tensor([[ord(ch) % 128 for ch in t[:TEXT_LEN].ljust(TEXT_LEN)] for t in batch["task"]])}
        if train:
            action = batch["action"].float()
            out["action"] = torch.nn.functional.pad(action, (0, c.max_action_dim - action.shape[-1]))
            out["action_is_pad"] = batch["action_is_pad"]
        return out

    def postprocess(self, actions: torch.Tensor) -> torch.Tensor:
        return self.normalizer.unnormalize_action(actions[..., : self.meta["action_dim"]])

    def save(self, directory: Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "toy_processor.json").write_text(json.dumps(self.meta))

    @classmethod
    def load(cls, directory: Path, config: PolicyConfig) -> ToyProcessor:
        meta = json.loads((Path(directory) / "toy_processor.json").read_text())
        norm = Normalizer(meta["stats"], meta["features"], {"STATE": "MEAN_STD", "ACTION": "MEAN_STD"})
        return cls(config, norm, meta)  # type: ignore[arg-type]


SPEC = PolicySpec(name="toy", config_class=ToyConfig, policy_class=ToyPolicy, processor_class=ToyProcessor,
                  presets={"tiny": ToyConfig()})
if "toy" not in POLICIES._entries:  # noqa: SLF001 (a re-import of this module must not register twice)
    POLICIES.add("toy", SPEC)

__all__ = ["SPEC", "ToyConfig", "ToyPolicy", "ToyProcessor", "asdict"]
