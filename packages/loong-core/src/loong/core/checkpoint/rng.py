"""Every random-number generator a continuation needs, saved per rank.

Python's ``random``, NumPy's global generator, torch's CPU generator, every CUDA device's generator
and whatever streams the engine's library keeps (megatron-core's model-parallel RNG tracker: the
streams dropout uses inside tensor-parallel regions), given by the engine. Each rank's states differ
(the tracker is seeded per TP/PP rank), so each rank writes its own file; a run resumed at a different world size cannot map the streams and starts them afresh.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

RNG_DIR = "rng"


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def capture_rng_state(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """This process's generator states, plus ``extra`` (the engine's own streams)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        # as plain values, so the file loads with torch.load(weights_only=True): nothing is unpickled
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "torch_cpu": torch.get_rng_state(),
        **(extra or {}),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any], restore_extra: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Set this process's generators to ``state`` (from :func:`capture_rng_state`); ``restore_extra(state)``
    restores the engine's own streams."""
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch_cpu"])
    if restore_extra is not None:
        restore_extra(state)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_rng_states(directory: Path, extra: dict[str, Any] | None = None) -> None:
    """Write this rank's generator states (and ``extra``) under ``directory/rng/`` (every rank calls it)."""
    rank, world = _rank_world()
    out = Path(directory) / RNG_DIR
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"world_size": world, "state": capture_rng_state(extra)}, out / f"rank_{rank:05d}.pt")


def load_rng_states(directory: Path,
                    restore_extra: Callable[[dict[str, Any]], None] | None = None) -> str | None:
    """Restore this rank's generators from ``directory``; returns why not, or None when restored."""
    rank, world = _rank_world()
    path = Path(directory) / RNG_DIR / f"rank_{rank:05d}.pt"
    if not path.is_file():
        return "the checkpoint holds no RNG states"
    saved = torch.load(path, weights_only=True)
    if saved["world_size"] != world:
        return f"it was saved by {saved['world_size']} processes, this run has {world}"
    restore_rng_state(saved["state"], restore_extra)
    return None
