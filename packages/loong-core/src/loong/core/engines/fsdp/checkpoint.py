"""The fsdp engine's checkpoints: torch DCP (``torch.distributed.checkpoint``), sharded and layout-independent.

The state is torch's own ``get_state_dict(model, optimizer)``: keys are the bare model's parameter names
(wrappers stripped), each value a DTensor (FSDP2) or a whole tensor (DDP); the optimiser's state is keyed by
the same names. DCP saves each rank's shards once (replicas write nothing twice) and loads them into whatever
layout the resuming run has: a dp_shard=2 checkpoint resumes at dp_shard=1, under HSDP or under DDP. Frozen
parameters are in the model state only; the optimiser holds none for them.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from loong.core.engines.base import PendingSave
from loong.core.errors import LoongError


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` as DCP saves and loads it."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def saved_tensors(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor a DCP checkpoint holds, by flattened key (``model.<name>``, ``optimizer.state.<name>.<k>``),
    with its global shape."""
    meta = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    return {k: tuple(getattr(v, "size", ())) for k, v in meta.items()}


def check_same_model(directory: Path, model_sd: dict[str, Any], allow_missing: bool) -> set[str]:
    """Refuse a checkpoint of another model, naming the differing keys; returns the model keys it lacks (only
    allowed with ``allow_missing``, for weights-only checkpoints)."""
    saved = {k[len("model."):]: shape for k, shape in saved_tensors(directory).items() if k.startswith("model.")}
    ours = {k: tuple(v.shape) for k, v in model_sd.items() if isinstance(v, torch.Tensor)}
    missing = sorted(set(ours) - set(saved))
    unexpected = sorted(set(saved) - set(ours))
    reshaped = sorted(k for k in set(ours) & set(saved) if ours[k] != saved[k])
    problems = []
    if missing and not allow_missing:
        problems.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        problems.append(f"not in this model {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    if reshaped:
        problems.append("other shapes " + ", ".join(f"{k} {saved[k]} vs {ours[k]}" for k in reshaped[:5]))
    if problems:
        raise LoongError(f"{directory} holds another model's weights: {'; '.join(problems)}")
    return set(missing)


def save(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Collective: write the model and optimiser shards under ``directory``."""
    dcp.save(training_state(model, optimizer), checkpoint_id=str(directory))


def load(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, load_optimizer: bool,
         allow_missing: bool) -> None:
    """Collective: read ``directory`` into the model (and optimiser) at this run's layout."""
    state = training_state(model, optimizer)
    absent = check_same_model(directory, state["model"], allow_missing)
    for key in absent:
        del state["model"][key]
    if not load_optimizer:
        del state["optimizer"]
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state.get("optimizer", {}),
                   options=StateDictOptions(strict=not absent))


class DCPPendingSave(PendingSave):
    """A ``dcp.async_save`` in flight; ``finish`` agrees over all ranks that every write ended."""

    def __init__(self, future: Any, finalize: Callable[[], None], device: torch.device) -> None:
        self.future: Future = getattr(future, "upload_completion", future)  # torch >= 2.9 may return a response
        self.finalize, self.device = finalize, device

    def finish(self, blocking: bool) -> bool:
        if blocking:
            self.future.result()
        done = torch.tensor([1.0 if self.future.done() else 0.0], device=self.device)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item() < 1.0:
            return False
        self.future.result()  # raises here if the write failed
        self.finalize()
        return True


def save_async(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, finalize: Callable[[], None],
               cpu_group: Any, device: torch.device) -> DCPPendingSave:
    """Stage the state to host memory now and write it in a background thread (``train.async_save``)."""
    future = dcp.async_save(training_state(model, optimizer), checkpoint_id=str(directory),
                            process_group=cpu_group)
    return DCPPendingSave(future, finalize, device)
