"""Read a checkpoint's tensors without building its model (for tools and tests that compare checkpoints)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch


def checkpoint_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a step directory's shards (model and optimiser), whole, by dotted key.

    Both engines write torch DCP's format (megatron-core's ``torch_dist`` is DCP underneath), so one reader serves
    both; nothing is unpickled beyond DCP's own metadata and the tensors it writes.
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(step_dir), f"{tmp}/all.pt")
        state = torch.load(f"{tmp}/all.pt", weights_only=False)  # written just now by DCP from our own shards
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, node: Any) -> None:
        if torch.is_tensor(node):
            flat[prefix] = node
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)

    walk("", state)
    return flat
